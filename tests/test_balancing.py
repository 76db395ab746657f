"""Quantile Balancing and the sign update (training/balancing.py), the static-shape dispatcher (model/dispatcher.py)
against a plain per-assignment reference, and the no-host-sync property of a MoE layer under expert parallelism,
also over token tiles with recomputation (train.tile_tokens, train.recompute)."""

from types import SimpleNamespace

import pytest
import torch
from dist_utils import run_distributed

from megatron_k3.config import MoEConfig, load_model_config
from megatron_k3.training.balancing import BiasBalancer


def _layer(E, k, bias=None):
    gate = SimpleNamespace(e_score_correction_bias=torch.zeros(E) if bias is None else bias.clone())
    return SimpleNamespace(num_experts=E, top_k=k, gate=gate)


def _skewed_scores(N, E, seed):
    g = torch.Generator().manual_seed(seed)
    # experts differ systematically (some are popular), tokens differ randomly
    return torch.sigmoid(torch.randn(N, E, generator=g) + torch.linspace(-1.5, 1.5, E))


def _selected_counts(scores, bias, k):
    return torch.bincount((scores + bias).topk(k, dim=-1).indices.reshape(-1), minlength=scores.shape[1])


@pytest.mark.parametrize("N,E,k", [(512, 16, 4), (1000, 64, 8), (333, 7, 2)])
def test_quantile_update_gives_every_expert_exactly_q_tokens_above_the_old_cutoff(N, E, k):
    scores = _skewed_scores(N, E, N)
    b0 = torch.randn(E) * 0.05
    layer = _layer(E, k, b0)
    bal = BiasBalancer(layer, MoEConfig(balancing="quantile", quantile_estimator="exact"))
    bal.observe(scores, b0)
    b_hat = bal._quantile_exact()  # before centring
    cutoff = (scores + b0).topk(k + 1, dim=-1).values[:, -1:]
    mu = (scores - cutoff).double()
    q = N * k // E
    # the defining property: q tokens have s + b^ > c. Margins tie (every token whose first unchosen expert is
    # e has mu = -b0[e] exactly), so in general: #(mu > -b^) <= q < #(mu >= -b^)
    above, at_least = (mu > -b_hat).sum(0), (mu >= -b_hat).sum(0)
    assert bool((above <= q).all()) and bool((at_least > q).all()), (above, at_least, q)
    assert (above == q).float().mean() > 0.5  # and mostly exactly q
    bal.step()
    b = layer.gate.e_score_correction_bias
    torch.testing.assert_close(b.double(), b_hat - b_hat.mean(), rtol=0, atol=1e-6)  # centred, fp32


def test_quantile_balancing_flattens_a_skewed_router_and_sign_moves_the_right_way():
    E, k, N = 32, 4, 4096
    scores = _skewed_scores(N, E, 0)
    before = _selected_counts(scores, torch.zeros(E), k).double()
    layer = _layer(E, k)
    bal = BiasBalancer(layer, MoEConfig(balancing="quantile", quantile_estimator="exact"))
    ratios = []
    for _ in range(8):  # the cutoff moves with the bias; repeated rounds on the same scores settle it
        bal.observe(scores, layer.gate.e_score_correction_bias)
        bal.step()
        after = _selected_counts(scores, layer.gate.e_score_correction_bias, k).double()
        ratios.append(float(after.max() / after.mean()))
    assert before.max() / before.mean() > 2.0
    assert ratios[0] < 1.25 and ratios[-1] < 1.03, ratios  # measured: 1.20 after one round, 1.01 after eight
    layer = _layer(E, k)
    sign = BiasBalancer(layer, MoEConfig(balancing="sign", sign_rate=0.01))
    sign.observe(scores, layer.gate.e_score_correction_bias)
    sign.step()
    b = layer.gate.e_score_correction_bias
    assert torch.equal(b, 0.01 * torch.sign(before.mean() - before).float())


@pytest.mark.parametrize("bins", [256, 4096])
def test_histogram_quantile_is_within_one_bin_of_the_exact_one(bins):
    E, k, N = 24, 3, 3000
    scores = _skewed_scores(N, E, 7)
    b0 = torch.randn(E) * 0.1
    out = {}
    for est in ("exact", "histogram"):
        layer = _layer(E, k, b0)
        bal = BiasBalancer(layer, MoEConfig(quantile_estimator=est, histogram_bins=bins))
        for part in scores.chunk(3):  # three micro-batches
            bal.observe(part, b0)
        bal.step()
        out[est] = layer.gate.e_score_correction_bias
    width = (2.0 + float(b0.max() - b0.min())) / bins
    # both are centred: the difference of the centred values is within two bin widths at most
    err = (out["exact"] - out["histogram"]).abs().max()
    assert err <= 2 * width, (err, width)


def _pooled_worker(rank, world, est):
    E, k = 16, 4
    scores = _skewed_scores(800, E, 3)
    layer = _layer(E, k)
    bal = BiasBalancer(layer, MoEConfig(quantile_estimator=est, histogram_bins=512), group=None)
    bal.observe(scores.chunk(world)[rank], layer.gate.e_score_correction_bias)
    bal.step()
    return layer.gate.e_score_correction_bias


@pytest.mark.slow
@pytest.mark.parametrize("est", ["exact", "histogram"])
def test_statistics_are_pooled_over_ranks(est):
    E, k = 16, 4
    layer = _layer(E, k)
    bal = BiasBalancer(layer, MoEConfig(quantile_estimator=est, histogram_bins=512))
    bal.observe(_skewed_scores(800, E, 3), layer.gate.e_score_correction_bias)
    bal.step()
    for b in run_distributed(_pooled_worker, 2, est, timeout=120):
        assert torch.allclose(b, layer.gate.e_score_correction_bias, atol=1e-7)


def test_static_dispatch_equals_per_assignment_reference_and_drops_over_capacity():
    from megatron_k3.model.dispatcher import Dispatcher, capacity
    from megatron_k3.model.experts import GroupedExperts

    torch.manual_seed(0)
    N, k, E, L = 40, 3, 8, 16
    experts = GroupedExperts(E, L, 24, "situ")
    for w in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(w, std=0.2)
    z = torch.randn(N, L, requires_grad=True)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    idx[:20, 0] = 2  # expert 2 is popular: over capacity at factor 1
    w = torch.rand(N, k)
    dropped = {}
    for cf, overflow in ((E / k, "drop"), (1.0, "drop"), (1.0, "dropless")):
        r, kept = Dispatcher(overflow, cf)(z, idx, w, experts)
        cap = capacity(N, k, E, cf)
        # reference: assignment (n, j) is computed iff fewer than `cap` earlier assignments went to its expert
        keep = torch.ones(N, k, dtype=torch.bool)
        if overflow == "drop":
            seen = torch.zeros(E, dtype=torch.long)
            for n in range(N):
                for j in range(k):
                    e = idx[n, j]
                    keep[n, j] = seen[e] < cap
                    seen[e] += 1
        y = experts.forward_reference(z.repeat_interleave(k, 0), idx.reshape(-1)).view(N, k, L)
        ref = (y * w[..., None] * keep[..., None]).sum(1)
        torch.testing.assert_close(r, ref, rtol=1e-5, atol=1e-6)
        if overflow == "drop":
            assert torch.equal(kept.view(N, k), keep)
            dropped[cf] = int((~keep).sum())
        g_r, = torch.autograd.grad(r.square().sum(), z)
        g_ref, = torch.autograd.grad(ref.square().sum(), z)
        torch.testing.assert_close(g_r, g_ref, rtol=1e-4, atol=1e-6)
    assert dropped[E / k] == 0 and dropped[1.0] > 0, dropped  # factor E/k admits everything; 1.0 drops


_SYNCING = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


def _static_worker(rank, world, overflow="drop", tile=0, modules=()):
    """One MoE layer's forward and backward at ep=`world` under `overflow`, with `tile`-token tiles and the selective
    recomputation of `modules` applied from outside (0, (): none): the host reads trapped, the all-to-alls' splits."""
    import torch.distributed as dist

    from megatron_k3.model.moe import StableLatentMoE
    from megatron_k3.parallel import ParallelGroups, parallelize, recompute, state, tiling
    from megatron_k3.training.balancing import BiasBalancer as Balancer

    ps = state.initialize_model_parallel(ep=world)
    try:
        cfg = load_model_config("k3_tiny", [f"moe_overflow={overflow}", "moe_capacity_factor=1.25"])
        torch.manual_seed(rank)
        moe = parallelize(StableLatentMoE(cfg), ParallelGroups.from_state(ps))
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.05)
        moe.balance = Balancer(moe, MoEConfig(quantile_estimator="histogram"), state.get_group("tp-dp-cp"))
        if modules:
            recompute.apply(moe, recompute.Policy("selective", modules))
        tiling.apply(moe, tile, overflow)
        x = torch.randn(2, 64, cfg.hidden_size, requires_grad=True)
        calls, splits = [], []
        real_a2a = dist.all_to_all_single

        def a2a(out, inp, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            splits.append((output_split_sizes, input_split_sizes))
            return real_a2a(out, inp, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        saved = {name: getattr(torch.Tensor, name) for name in _SYNCING}

        def trap(name):
            def f(self, *a, **kw):
                calls.append(name)
                return saved[name](self, *a, **kw)
            return f

        dist.all_to_all_single = a2a
        for name in _SYNCING:
            setattr(torch.Tensor, name, trap(name))
        try:
            moe.train()
            y = moe(x)
            y.square().sum().backward()
        finally:
            dist.all_to_all_single = real_a2a
            for name, f in saved.items():
                setattr(torch.Tensor, name, f)
        return calls, splits, x.grad.abs().sum().item() > 0
    finally:
        state.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("overflow,exchanges,tile,modules", [
    ("drop", 4, 0, ()), ("balanced", 14, 0, ()),
    # 4 tiles of 32 rows, each exchanging as the whole layer does, and again in the backward (the tile's
    # checkpoint runs its forward's 8 once more); the routed experts' activation rebuilt in the backward
    ("balanced", 4 * (14 + 8), 32, ("moe_act", "layernorm"))], ids=["drop", "balanced", "balanced_tiled"])
def test_static_dispatch_never_syncs_with_the_host_and_sends_no_split_sizes(overflow, exchanges, tile, modules):
    """drop: dispatch and combine, forward and backward. balanced: forward 8 (weights to the relays and on to the
    replicas, the rows' destinations and the rows through the relays, their outputs back), backward 6 (the
    differentiable ones reversed). Tiled and recomputed (train.tile_tokens, train.recompute=selective): the same per
    tile, and no host read either."""
    for calls, splits, has_grad in run_distributed(_static_worker, 2, overflow, tile, modules, timeout=120):
        assert has_grad
        assert len(splits) == exchanges
        assert all(s == (None, None) for s in splits), splits
        assert calls == [], calls


@pytest.mark.parametrize("tile", [0, 32], ids=["untiled", "tiled"])
def test_dropless_one_rank_never_syncs_with_the_host(tile):
    """One EP rank, dropless (the default there): grouped GEMMs with device offsets, fused gate/up and combine;
    nothing in forward or backward reads a tensor on the host, untiled or over 32-token tiles (train.tile_tokens)
    with the routed experts' activation recomputed (train.recompute=selective)."""
    from megatron_k3.model.moe import StableLatentMoE
    from megatron_k3.parallel import recompute, tiling

    cfg = load_model_config("k3_tiny", ["moe_overflow=dropless"])
    torch.manual_seed(0)
    moe = StableLatentMoE(cfg).train()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    if tile:
        recompute.apply(moe, recompute.Policy("selective", ("moe_act",)))
        tiling.apply(moe, tile, "dropless")
    x = torch.randn(2, 64, cfg.hidden_size, requires_grad=True)
    calls, saved = [], {name: getattr(torch.Tensor, name) for name in _SYNCING}

    def trap(name):
        def f(self, *a, **kw):
            calls.append(name)
            return saved[name](self, *a, **kw)
        return f

    for name in _SYNCING:
        setattr(torch.Tensor, name, trap(name))
    try:
        moe(x).square().sum().backward()
    finally:
        for name, f in saved.items():
            setattr(torch.Tensor, name, f)
    assert calls == [], calls
    assert moe.experts.w1.grad is not None and x.grad.abs().sum() > 0


def test_default_overflow_is_static_under_expert_parallelism():
    """model.moe_overflow=auto (the default): the static `drop` dispatch whenever experts are sharded, so the
    default path never exchanges split sizes; one EP rank keeps `dropless` (device-side grouped GEMM offsets)."""
    from megatron_k3.config import ModelConfig
    from megatron_k3.parallel.experts import resolve_overflow

    assert ModelConfig().moe_overflow == "auto"
    assert resolve_overflow("auto", True) == "drop" and resolve_overflow("auto", False) == "dropless"
    assert resolve_overflow("dropless", True) == "dropless" and resolve_overflow("drop", False) == "drop"


def _overlap_worker(rank, world, tp):
    import torch.distributed as dist

    from megatron_k3.model.moe import StableLatentMoE
    from megatron_k3.parallel import ParallelGroups, parallelize, state
    from megatron_k3.parallel import experts as dispatcher
    from megatron_k3.parallel.mappings import all_to_all

    ps = state.initialize_model_parallel(tp=tp, ep=world // tp)
    try:
        cfg = load_model_config("k3_tiny", ["moe_overflow=drop", "moe_capacity_factor=1.25"])
        torch.manual_seed(0)
        moe = parallelize(StableLatentMoE(cfg), ParallelGroups.from_state(ps))
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.05)
        torch.manual_seed(1 + rank // tp)  # distinct tokens per EP rank, the same on the TP ranks of one
        x = torch.randn(2, 32, cfg.hidden_size)
        events = []
        real_a2a, real_overlapped = dist.all_to_all_single, dispatcher.all_to_all_overlapped

        def a2a(out, inp, *a, async_op=False, **kw):
            events.append("a2a_async" if async_op else "a2a")
            return real_a2a(out, inp, *a, async_op=async_op, **kw)

        shared = moe.shared_experts
        shared.register_forward_pre_hook(lambda m, a: events.append("shared_fwd"))
        shared.down_proj.weight.register_hook(lambda g: events.append("shared_bwd"))
        results = {}
        for mode in ("overlapped", "sequential"):
            if mode == "sequential":
                dispatcher.all_to_all_overlapped = lambda t, group, side: (all_to_all(t, group), side())
            dist.all_to_all_single = a2a
            events.clear()
            moe.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            try:
                y = moe(xi)
                y.square().sum().backward()
            finally:
                dist.all_to_all_single, dispatcher.all_to_all_overlapped = real_a2a, real_overlapped
            results[mode] = (y.detach(), xi.grad, {n: p.grad.clone() for n, p in moe.named_parameters()},
                             list(events))
        return results
    finally:
        state.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_shared_experts_overlap_the_dispatch_all_to_all_with_identical_results(tp):
    """Under expert parallelism the shared experts' forward runs while the dispatch all-to-all is in flight and
    their backward while the reverse one is; values and gradients equal the sequential form bit for bit."""
    for res in run_distributed(_overlap_worker, 2 * tp, tp, timeout=180):
        (y, gx, grads, ev), (y_s, gx_s, grads_s, ev_s) = res["overlapped"], res["sequential"]
        assert torch.equal(y, y_s) and torch.equal(gx, gx_s)
        assert all(torch.equal(grads[n], grads_s[n]) for n in grads)
        # forward: dispatch started asynchronously, shared experts, then the (synchronous) combine all-to-all;
        # backward: the combine's reverse, then the dispatch's reverse started asynchronously before the shared
        # experts' weight gradient is computed
        assert ev == ["a2a_async", "shared_fwd", "a2a", "a2a", "a2a_async", "shared_bwd"], ev
        assert ev_s.index("shared_fwd") > ev_s.index("a2a") and ev_s.count("a2a_async") == 0, ev_s
