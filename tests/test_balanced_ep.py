"""Balanced expert parallelism (model.moe_overflow=balanced, megatron_k3.parallel.balanced): the plan on its own
(every rank exactly M pairs, at most one donor and at most E/R replicas per rank, for any loads), and the dispatch
over 2 and 4 gloo ranks against the single-process dropless layer, output and every gradient, for random,
Zipf-skewed and adversarial routing. fp32; the tolerance (1e-6 relative) covers the changed order of the k-term fp32
combine and of the replica gradients summed into their owner's. The replicas' copies ([w1; w3] with the replicas,
their matrices split off the received block, the relay store's rows) are exact, and each makes one tensor."""

import pytest
import torch
from dist_utils import run_distributed
from helpers import max_abs_rel

from megatron_k3.model.dispatcher import Dispatcher
from megatron_k3.model.experts import GroupedExperts
from megatron_k3.parallel.balanced import alias_plan, compute_capacity, slot_layout, streams

RTOL = 1e-6


def _check_plan(loads_E, R, M, S):
    El = loads_E.numel() // R
    ends, perm = streams(loads_E.view(R, El))
    plan = alias_plan(ends, M, S)
    rows, rep = slot_layout(ends, perm, plan, S)
    given, donor, dstart, damt = plan
    # every expert's pairs are computed exactly once: own kept + donated ranges tile each stream
    for o in range(R):
        ranges = sorted([(int(dstart[r]), int(dstart[r] + damt[r])) for r in range(R) if donor[r] == o and damt[r]])
        ranges.append((int(given[o]), int(ends[o, -1])))
        at = 0
        for a, b in ranges:
            assert a == at, (o, ranges)
            at = b
        assert at == int(ends[o, -1])
    per_expert = torch.zeros(R * El, dtype=torch.long)
    for d in range(R):
        per_expert[d * El:(d + 1) * El] += rows[d, :El]
        per_expert.index_add_(0, rep[d], rows[d, El:])
    assert torch.equal(per_expert, loads_E)
    return rows.sum(1), (rows[:, El:] > 0).sum(1)


def _loads(kind, R, El, M, g):
    E = R * El
    if kind == "uniform_random":  # any nonnegative loads summing to R*M
        w = torch.rand(E, generator=g) ** 4
    elif kind == "one_hot":
        w = torch.zeros(E)
        w[int(torch.randint(E, (1,), generator=g))] = 1
    elif kind == "tiny_many":  # many tiny experts beside one giant: a range may span many experts
        w = torch.full((E,), 1e-4)
        w[int(torch.randint(E, (1,), generator=g))] = 1
    else:  # zipf
        w = 1.0 / torch.arange(1, E + 1).float() ** 1.5
        w = w[torch.randperm(E, generator=g)]
    loads = torch.floor(w / w.sum() * R * M).long()
    loads[int(torch.argmax(loads))] += R * M - int(loads.sum())
    return loads


@pytest.mark.parametrize("R,El", [(2, 4), (4, 2), (4, 8), (8, 3), (16, 1)])
def test_alias_plan_balances_exactly_with_one_donor_and_at_most_El_replicas(R, El):
    g = torch.Generator().manual_seed(R * 100 + El)
    M = 37 * R + 5
    for kind in ("uniform_random", "one_hot", "tiny_many", "zipf"):
        for _ in range(20):
            loads = _loads(kind, R, El, M, g)
            load_R, replicas_R = _check_plan(loads, R, M, El)
            assert torch.all(load_R == M), (kind, loads, load_R)
            assert torch.all(replicas_R <= El)


def test_the_replica_copies_are_exact_and_single():
    """The replicas' helpers are plain copies of what torch's ops give (values, dtype promotion, gradients), each
    making one tensor: the [w1; w3] of own experts and replicas written at once (not a concatenation of two), the
    replicas' matrices split off one received block (one gradient tensor back, not a zero-filled one per matrix), the
    relay store's rows taken with the gradients added in place."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_k3.ops.grouped_gemm import _cat13
    from megatron_k3.parallel.balanced import _TakeRows, _unflatten

    class Made(TorchDispatchMode):  # the elements of every new storage an op returns (not views, not in place)
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                    if isinstance(a, torch.Tensor)}
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    self.sizes.append(t.numel())
                    seen.add(t.untyped_storage().data_ptr())
            return out

    g = torch.Generator().manual_seed(0)
    for dtypes in ((torch.bfloat16,) * 4, (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)):
        w1, w3, r1, r3 = (torch.randn(n, 4, 5, generator=g).to(d) for n, d in zip((3, 3, 2, 2), dtypes))
        with Made() as made:
            got = _cat13(w1, w3, r1, r3)
        want = torch.cat([torch.cat([w1, w3], 1), torch.cat([r1, r3], 1)])
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert made.sizes == [got.numel()], made.sizes
    ws = (torch.empty(3, 4, 5), torch.empty(3, 4, 5), torch.empty(3, 5, 4))
    for width in (60, 64):  # P = 60, padded or not
        flat = torch.randn(2, width, generator=g, requires_grad=True)
        parts = _unflatten(flat, ws)
        assert [p.shape for p in parts] == [(2, 4, 5), (2, 4, 5), (2, 5, 4)]
        assert torch.equal(torch.cat([p.reshape(2, -1) for p in parts], 1), flat[:, :60])
        loss = sum((p * (i + 1)).sum() for i, p in enumerate(parts))
        with Made() as made:
            loss.backward()
        want = torch.cat([torch.full((2, 20), float(i + 1)) for i in range(3)] + [torch.zeros(2, width - 60)], 1)
        assert torch.equal(flat.grad, want)
        # the parts' gradients joined once (and put in the padded width once): slicing made one per matrix
        assert len([n for n in made.sizes if n >= 2 * 60]) == (1 if width == 60 else 2), made.sizes
    store = torch.randn(6, 3, generator=g, requires_grad=True)
    rows = torch.tensor([4, 0, 4, 2])
    up = torch.randn(4, 3, generator=g)
    (_TakeRows.apply(store, rows) * up).sum().backward()
    ref = store.detach().clone().requires_grad_()
    (ref.index_select(0, rows) * up).sum().backward()
    assert torch.equal(store.grad, ref.grad)


def test_fewer_slots_than_El_drop_nothing_and_report_the_imbalance():
    R, El, M = 4, 8, 64
    loads = torch.zeros(R * El, dtype=torch.long)
    loads[:El] = R * M // El  # every pair on rank 0's experts, spread evenly: each range spans many experts
    load_R, replicas_R = _check_plan(loads, R, M, 1)  # each receiver can take one expert: 32 of the 64 it lacks
    assert torch.all(replicas_R <= 1) and int(load_R.sum()) == R * M
    assert int(load_R.max()) > M  # rank 0 keeps what the slots could not take
    assert int(load_R.max()) <= compute_capacity(M // 4, 4, R, El, 1)
    load_R, _ = _check_plan(loads, R, M, El)
    assert torch.all(load_R == M)


def _routing(kind, N, E, k, g):
    if kind == "random":
        return torch.rand(N, E, generator=g).topk(k, dim=1).indices
    if kind == "zipf":
        logp = -1.2 * torch.log(torch.arange(1, E + 1).float())[torch.randperm(E, generator=g)]
        gumbel = -torch.log(-torch.log(torch.rand(N, E, generator=g).clamp_min(1e-20)))
        return (logp + gumbel).topk(k, dim=1).indices
    if kind == "two_owners":  # every token picks among the experts of EP ranks 0 and 1 only (2 * E/4 experts)
        return torch.rand(N, E // 2, generator=g).topk(k, dim=1).indices
    return torch.arange(k).repeat(N, 1)  # adversarial: every token picks the same k experts


def _worker(rank, world, kind, S, seed, micro=1):
    import torch.distributed as dist

    from megatron_k3.parallel.experts import ParallelDispatcher, _shard_experts
    from megatron_k3.parallel.mappings import Group
    from megatron_k3.parallel.tensor import TensorParallel
    torch.manual_seed(seed)
    E, k, L, I, N = 16, 4, 8, 12, 24
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(world * N, L, generator=g)
    idx = _routing(kind, world * N, E, k, g)
    w = torch.rand(world * N, k, generator=g)
    gy = torch.randn(world * N, L, generator=g)
    full = GroupedExperts(E, L, I, "situ")
    with torch.no_grad():
        for p in (full.w1, full.w3, full.w2):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    # reference: one process, dropless
    zr, wr = z.clone().requires_grad_(), w.clone().requires_grad_()
    ref, _ = Dispatcher("dropless")(zr, idx, wr, full)
    (ref * gy).sum().backward()
    # balanced over the EP group
    ep = Group(dist.group.WORLD, world, rank)
    local = GroupedExperts(E, L, I, "situ")
    local.load_state_dict(full.state_dict())
    _shard_experts(local, ep)
    disp = ParallelDispatcher("balanced", 1.0, TensorParallel(), ep, S, E)
    rows = slice(rank * N, (rank + 1) * N)
    zl, wl = z[rows].clone().requires_grad_(), w[rows].clone().requires_grad_()
    # micro > 1: the trainer's way, the owners' weight exchange once for `micro` micro-batches, then `flush`
    disp.balanced.cache_weights = micro > 1
    outs = []
    for part in torch.arange(N).chunk(micro):
        out, kept = disp(zl[part], idx[rows][part], wl[part], local)
        assert kept is None
        (out * gy[rows][part]).sum().backward()
        outs.append(out)
    disp.balanced.flush(local)
    out = torch.cat(outs)
    El = E // world
    block = slice(rank * El, (rank + 1) * El)
    pairs = {"out": (out, ref[rows]), "dz": (zl.grad, zr.grad[rows]), "dw": (wl.grad, wr.grad[rows]),
             **{n: (getattr(local, n).grad, getattr(full, n).grad[block]) for n in ("w1", "w3", "w2")}}
    errs = {k: max_abs_rel(a, b, float64=False) for k, (a, b) in pairs.items()}
    load_R, replicas = disp.balanced.stats
    return errs, load_R.tolist(), int(replicas)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["random", "zipf", "adversarial"])
def test_balanced_dispatch_equals_single_process_dropless(world, kind):
    for rank, (errs, load_R, replicas) in enumerate(run_distributed(_worker, world, kind, None, 7, timeout=120)):
        assert max(errs.values()) < RTOL, (rank, errs)
        assert load_R == [24 * 4] * world, load_R  # exactly M = N * k pairs on every rank
        if kind == "adversarial":
            assert replicas > 0


@pytest.mark.slow
def test_weights_exchanged_once_per_step_give_the_same_gradients():
    """cache_weights (what the trainer sets): 3 micro-batches share one owner-to-relay weight exchange, their replica
    gradients accumulate on the relays and `flush` returns them: the sum equals the whole batch's dropless layer."""
    for errs, _, _ in run_distributed(_worker, 4, "zipf", None, 11, 3, timeout=120):
        assert max(errs.values()) < RTOL, errs


@pytest.mark.slow
def test_balanced_dispatch_with_too_few_slots_is_still_exact_and_reports_the_imbalance():
    for errs, load_R, _ in run_distributed(_worker, 4, "two_owners", 1, 3, timeout=120):
        assert max(errs.values()) < RTOL, errs
        assert max(load_R) > 24 * 4 and sum(load_R) == 4 * 24 * 4
