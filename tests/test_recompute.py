"""Activation recomputation (train.recompute, megatron_k3.parallel.recompute) changes no number.

- One process, the model alone: the loss and every parameter's gradient bit for bit equal to no recomputation under
  each policy (selective with all modules and with a subset, full, full on the first 2 layers), with the dropless and
  the drop dispatcher, fp32 and MX QAT; what a forward records besides its output happens in the forward only (the
  router observation count, the load counts, the depth weights) and the RNG after the step is the same.
- The Trainer, under tp2 + sequence parallelism, pp2, ep2 (drop, dropless and balanced), cp2, the vision-language
  model at tp2 (its tower's blocks and attention recomputed too) and compiled (aot_eager): the
  losses, the expert loads and every parameter after each step bit for bit equal to none, the routers observed once
  per micro-batch and MoE layer, the RNG state after the steps the same; in the same runs activation offload (pp2)
  and parallel.overlap_grad_reduce (DeepSpeed's overlap_comm, dp2) bit for bit, sequence tiling (tp2 + SP, ep2
  balanced, cp2) to fp32 rounding. Under inductor (make test-compile, 2 threads, train.deterministic) every policy is
  bit for bit.

Bit for bit, not within a tolerance: a recomputed region runs the same operations on the same inputs in the same
order, so anything else is a defect. (Identical parameters after each AdamW step from identical states mean identical
updates, so identical gradients.)
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from helpers import (
    FAST,
    FULL_VOCAB,
    PARAM_RTOL,
    RTOL,
    STATIC,
    TINY_MODEL,
    ObservationCounter,
    full_params,
    norm_rel,
    wrapped_model,
)

from megatron_k3.parallel.recompute import Policy

POLICY_ORDER = ("none", "selective", "full")
POLICIES = [Policy("selective"), Policy("selective", ("core_attn", "moe_act")), Policy("full"),
            Policy("full", num_layers=2)]


def _model_step(policy: Policy, extra: list):
    from megatron_k3.model.decoder import DepthMix
    from megatron_k3.model.moe import StableLatentMoE

    model, cfg, wrapped = wrapped_model(TINY_MODEL + extra, policy)
    counter = ObservationCounter()
    moes = [m for m in model.modules() if isinstance(m, StableLatentMoE)]
    mixes = [m for m in model.modules() if isinstance(m, DepthMix)]
    for m in moes:
        m.balance = counter
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    out = model(ids, labels=ids)
    records = [id(m.tokens_per_expert_E) for m in moes] + [id(m.last_weights_N) for m in mixes]
    out.loss.backward()
    again = [id(m.tokens_per_expert_E) for m in moes] + [id(m.last_weights_N) for m in mixes]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, wrapped, counter.calls, records == again, torch.get_rng_state()


@pytest.mark.parametrize("extra", [[], ["model.moe_overflow=drop"], ["precision=mx_qat"]],
                         ids=["dropless", "drop", "mx_qat"])
def test_recompute_changes_no_gradient_in_one_process(extra):
    loss, grads, _, calls, _, rng = _model_step(Policy("none"), extra)
    assert calls == 3  # 3 MoE layers, each observed once
    for policy in POLICIES:
        got_loss, got, wrapped, got_calls, unchanged, got_rng = _model_step(policy, extra)
        assert sum(wrapped.values()) > 0, policy
        assert torch.equal(got_loss, loss), policy
        assert got.keys() == grads.keys(), policy
        different = [n for n, g in grads.items() if not torch.equal(got[n], g)]
        assert not different, (policy, different[:5])
        assert got_calls == calls, (policy, got_calls)  # the routers observed in the forward only
        assert unchanged, policy  # load counts and depth weights not written again by the recomputed pass
        assert torch.equal(got_rng, rng), policy


@pytest.mark.parametrize("policy,tile", [(Policy("full"), 0), (Policy("selective"), 0), (Policy("none"), 16),
                                         (Policy("full", offload_bytes=10**9), 16)],
                         ids=["full", "selective", "tiled", "offloaded_tiled"])
def test_the_recomputation_runs_under_the_forwards_te_autocast(monkeypatch, policy, tile):
    """precision=te_*: te.Linear runs in FP8 inside TE's autocast, which forward_context enters for the forward
    only; the backward's recomputation must enter it again (else it recomputes in bf16: other numbers). TE stood in
    for by a context that counts its entries (no TE here): every Linear call, the forward's and every recomputed
    one, runs inside it, and the registry it leaves behind is empty."""
    import contextlib

    import megatron_k3.precision as precision
    from megatron_k3.config import PrecisionConfig
    from megatron_k3.model.layers import recomputing
    from megatron_k3.parallel.recompute import FORWARD_CONTEXTS

    inside = [0]

    @contextlib.contextmanager
    def te_stand_in(name):
        inside[0] += 1
        try:
            yield
        finally:
            inside[0] -= 1

    monkeypatch.setattr(precision, "te_autocast", te_stand_in)
    model, cfg, _ = wrapped_model(TINY_MODEL + ["model.moe_overflow=dropless"], policy, tile)
    calls = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda *_: calls.append((recomputing(), inside[0] > 0)))
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with precision.forward_context(PrecisionConfig(name="te_fp8", dtype="bf16"), "cpu"):
        loss = model(ids, labels=ids).loss
    assert not FORWARD_CONTEXTS
    forward = len(calls)
    loss.backward()
    # some Linear recomputed (selective's regions hold none: nothing of TE's is rebuilt there)
    assert forward > 0 and (len(calls) > forward) == (policy.name != "selective"), (forward, len(calls))
    assert all(te for _, te in calls), [i for i, (_, te) in enumerate(calls) if not te][:5]


def test_a_checkpoint_in_the_forwards_contexts_runs_inside_a_compiled_graph():
    """Dynamo takes no context_fn of checkpointed_call's kind: under train.compile (a checkpoint traced inside a
    compiled graph: compile_split=layer's regions, token tiles in a compiled layer) with a te_* precision such a
    checkpoint runs eagerly, a graph break, and its recomputation still enters the forward's contexts; the gradient
    is eager's."""
    import contextlib

    from megatron_k3.parallel.recompute import FORWARD_CONTEXTS, checkpointed_call

    inside, seen = [0], []

    @contextlib.contextmanager
    def te_stand_in():
        inside[0] += 1
        try:
            yield
        finally:
            inside[0] -= 1

    def body(x):
        seen.append(inside[0] > 0)
        return torch.sin(x) * x

    def step(x):
        return checkpointed_call(body, x).sum() * 2

    x = torch.randn(8, requires_grad=True)
    FORWARD_CONTEXTS.append(te_stand_in)
    try:
        with te_stand_in():
            y = torch.compile(step, backend="aot_eager")(x)
    finally:
        FORWARD_CONTEXTS.remove(te_stand_in)
    y.backward()
    assert seen == [True, True]  # the forward, and the recomputation in the backward (outside the forward's context)
    compiled, x.grad = x.grad, None
    step(x).backward()
    assert torch.equal(compiled, x.grad)


@pytest.mark.parametrize("anchored", [False, True], ids=["cpu", "device_anchor"])
def test_a_recomputed_region_draws_the_same_random_numbers(monkeypatch, anchored):
    """A region that draws random numbers (as dropout would) and takes no tensor argument (as the offloaded layer's
    checkpoint does) draws the same again in its recomputation: the input's gradient is the forward's mask; the RNG
    after the backward is where the forward left it. `device_anchor`: with checkpointed_call's CUDA device anchor in
    the call (stood in for by a CPU tensor: no GPU here; bench/gpu_check.py's recompute check draws on CUDA), the
    region gets its own arguments."""
    from megatron_k3.parallel import recompute

    if anchored:
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(recompute, "_ANCHORS", {0: torch.empty(0)})
    x = torch.randn(64, requires_grad=True)
    masks, seen = [], []

    def region(scale, *, shift):
        seen.append((scale, shift))
        masks.append(torch.rand(64))
        return (x * masks[-1] * scale + shift).sum()

    out = recompute.checkpointed_call(region, 2.0, shift=1.0)
    after_forward = torch.get_rng_state()
    out.backward()
    assert len(masks) == 2 and torch.equal(masks[0], masks[1]) and seen == [(2.0, 1.0)] * 2
    assert torch.equal(x.grad, 2 * masks[0]) and torch.equal(after_forward, torch.get_rng_state())


def test_policies_wrap_the_regions_the_planner_names():
    _, _, wrapped, *_ = _model_step(Policy("selective"), [])
    # 4 layers: 2 norms each, 3 MoE latent norms and the final norm; 9 depth mixes (2 per layer, and the output's);
    # 4 mixers; layer 0's dense FFN and 3 shared experts; 3 routed-expert sets
    assert wrapped == {"layernorm": 12, "attn_res": 9, "core_attn": 4, "mlp_act": 4, "moe_act": 3}
    assert _model_step(Policy("full", num_layers=3), [])[2] == {"layers": 3, "vision_blocks": 0}


def test_bad_recompute_keys_name_the_key_and_what_is_valid():
    from megatron_k3.config import ConfigError, compose_config

    for overrides, key in ((["train.recompute=some"], "train.recompute"),
                           (["train.recompute=selective", "train.recompute_modules=[mlp]"], "train.recompute_modules"),
                           (["train.recompute_modules=[core_attn]"], "train.recompute_modules"),
                           (["train.recompute=full", "train.recompute_num_layers=-1"], "train.recompute_num_layers"),
                           (["train.recompute=selective", "train.recompute_num_layers=2"],
                            "train.recompute_num_layers")):
        run, _, _ = compose_config(overrides)
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            run.validate()
    # a module the model has no region of, and more layers than a pipeline stage holds, are refused, not run as none
    # or as every layer
    for overrides, message in (
            (["model=kimi_linear_tiny", "train.recompute=selective", "train.recompute_modules=[attn_res,moe_act]"],
             r"train\.recompute_modules=\['attn_res', 'moe_act'\]: model kimi_linear_tiny has no attn_res region.*"
             r"its modules: layernorm, core_attn, mlp_act, moe_act"),
            (["train.recompute=full", "train.recompute_num_layers=5", "parallel.pp=2"],
             r"train\.recompute_num_layers=5: more than the 4 layers of the largest pipeline stage.*at most 4")):
        run, _, _ = compose_config(overrides)
        with pytest.raises(ConfigError, match=message):
            run.validate(2)
    compose_config(["train.recompute=full", "train.recompute_num_layers=4", "parallel.pp=2"])[0].validate(2)


@pytest.mark.parametrize("name", ["k3_tiny", "kimi_linear_tiny", "k3_vl_tiny"])
def test_the_modules_a_config_names_are_the_regions_its_model_has(name):
    """config.schema.recompute_regions (what train.recompute_modules may name) from the model config alone equals the
    kinds parallel.recompute wraps at least once in the built model."""
    from megatron_k3.config.schema import recompute_regions

    _, cfg, wrapped = wrapped_model([f"model={name}"], Policy("selective"))
    assert set(recompute_regions(cfg)) == {k for k, n in wrapped.items() if n > 0}
    with pytest.raises(ValueError, match="moe"):
        Policy("selective", ("moe",))
    for kwargs in ({"num_layers": -1}, {"num_layers": 1.5}, {"offload_bytes": -5}, {"offload_bytes": True}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):  # the Python API as the config: no -1 slicing
            Policy("full", **kwargs)


# ---------------------------------------------------------------------------------------------- the Trainer


@pytest.mark.slow
def test_auto_says_what_it_resolved_to_and_that_an_offload_it_cannot_use_is_unused(caplog, tmp_path):
    """train.recompute=auto (train=pretrain's default) on k3 tiny resolves to none: rank 0 logs the policy it chose;
    train.offload_buffer_gb, which only full uses, is named unused instead of being dropped in silence."""
    from helpers import make_trainer

    from megatron_k3.training.engine import shutdown

    with caplog.at_level("INFO", logger="megatron_k3"):
        try:
            t = make_trainer(1, ["train.recompute=auto", "train.offload_buffer_gb=1"], steps=1,
                             run_dir=str(tmp_path))
        finally:
            shutdown()
    assert t.recompute == "none" and getattr(t.model, "host_offload", None) is None
    assert "train.recompute=none (auto: the least the planner says fits)" in caplog.text
    assert "train.offload_buffer_gb=1 unused" in caplog.text and "resolved to none" in caplog.text


def _policies(rank, world, overrides, run_dir, extra=(), policies=POLICY_ORDER, threads=1):
    """2 steps of FAST + overrides under each train.recompute policy of `policies`, and each (name, overrides) of
    `extra`, on `threads` CPU threads: per variant (losses, loads, parameters after each step, router observations,
    the RNG state after)."""
    from megatron_k3.config import compose_run_config
    from megatron_k3.training.engine import shutdown
    from megatron_k3.training.loop import Trainer

    torch.set_num_threads(threads)
    out = {}
    variants = [(p, [f"train.recompute={p}"]) for p in policies] + list(extra)
    for name, more in variants:
        run, _, _ = compose_run_config(FAST + overrides + more + ["train.steps=2"], world_size=world)
        try:
            torch._dynamo.reset()  # each run compiles afresh (a later compile in a process can differ from the first)
            torch.manual_seed(0)
            trainer = Trainer(run, f"{run_dir}/{name}/{rank}")
            observed = [0]
            for b in trainer.balancers:
                orig = b.observe

                def observe(*args, _orig=orig, _observed=observed):
                    _observed[0] += 1
                    return _orig(*args)
                b.observe = observe
            steps = []
            for _ in range(2):
                rec, loads = trainer.train_step()
                steps.append((rec["loss"], loads.clone(), full_params(trainer)))
            out[name] = (steps, observed[0], len(trainer.balancers) * trainer.num_micro * 2, torch.get_rng_state())
        finally:
            shutdown()
    return out


def _assert_same(results, what, rounding=(), against=None):
    """Every variant's run equal to none's (or that of the variant `against` names for it) bit for bit, those in
    `rounding` to fp32 rounding instead (losses within RTOL, parameters within PARAM_RTOL per tensor in norm, as the
    layout tests hold a layout to one process)."""
    for rank, res in enumerate(results):
        for policy in res:
            ref_steps, ref_obs, expected_obs, ref_rng = res[(against or {}).get(policy, "none")]
            assert ref_obs == expected_obs, (what, rank, ref_obs, expected_obs)
            steps, obs, _, rng = res[policy]
            assert obs == ref_obs, (what, rank, policy, obs, ref_obs)
            assert torch.equal(rng, ref_rng), (what, rank, policy)
            for s, ((loss, loads, params), (l0, loads0, p0)) in enumerate(zip(steps, ref_steps)):
                assert torch.equal(loads, loads0), (what, rank, policy, s)
                if policy in rounding:
                    worst = max(norm_rel(params[n], p0[n]) for n in p0)
                    print(f"{what} {policy} step {s}: loss {abs(loss - l0) / abs(l0):.2g}, parameters {worst:.2g}")
                    assert abs(loss - l0) <= RTOL * abs(l0) and worst < PARAM_RTOL, (what, policy, s, loss, l0, worst)
                    continue
                assert loss == l0, (what, rank, policy, s, loss, l0)
                bad = [n for n in p0 if not torch.equal(params[n], p0[n])]
                assert not bad, (what, rank, policy, s, bad[:4])


TILED = ("tiled", ["train.tile_tokens=16"])  # to fp32 rounding (tests/test_tiling.py says why)


@pytest.mark.slow
@pytest.mark.parametrize("world,overrides,extra", [
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "train.deterministic=true"], [TILED]),
    (2, ["parallel.pp=2"], [("offloaded", ["train.recompute=full", "train.offload_buffer_gb=1"])]),
    # dp2 (the dense parameters' data parallelism): DeepSpeed's overlap_comm changes no number either
    (2, ["parallel.ep=2"] + STATIC, [("overlap_grad_reduce", ["parallel.overlap_grad_reduce=true"])]),
    (2, ["parallel.ep=2", "model.moe_overflow=dropless"], []),
    (2, ["parallel.ep=2", "model.moe_overflow=balanced"], [TILED]),
    (2, ["parallel.cp=2"], [TILED]),
    (2, ["model=k3_vl_tiny", "data=multimodal", "parallel.tp=2", FULL_VOCAB], []),  # the tower's blocks, attention
    (1, ["train.compile=true", "train.compile_backend=aot_eager", "train.deterministic=true"],
     [("offloaded", ["train.recompute=full", "train.offload_buffer_gb=1"])]),
], ids=["tp2_sp", "pp2", "ep2_drop", "ep2_dropless", "ep2_balanced", "cp2", "vision_tp2", "compiled_aot_eager"])
def test_recompute_is_bit_identical_under_every_layout(tmp_path, world, overrides, extra):
    """Also, per layout: sequence tiling (to rounding), activation offload under pp2 and the overlapped gradient
    reduction at dp2 (bit for bit), each against the same layout's none; tp2 + SP and compiled under
    train.deterministic. Compiled: none, selective (its regions compiled as graphs of their own, checkpointed between
    the layer's graphs: train.compile_split=regions), full with its layer inputs offloaded (full wraps the compiled
    layer and calls the same compiled code again, reading the inputs back from host memory) and selective with each
    layer one graph (compile_split=layer: the regions traced inside it as torch's checkpoint operator, bit for bit
    under aot_eager, which runs the traced operations as they are); test_recompute_under_inductor checks the
    policies under inductor (make test-compile)."""
    policies = POLICY_ORDER[:2] if "train.compile=true" in overrides else POLICY_ORDER
    results = run_distributed(_policies, world, overrides, str(tmp_path), extra, policies, timeout=900)
    _assert_same(results, overrides, ("tiled",))


@pytest.mark.slow
@pytest.mark.compile
def test_recompute_under_inductor(tmp_path):
    """train.compile=true with inductor on 2 threads under train.deterministic: none, selective and full bit for bit.
    Selective checkpoints each region's own compiled graph (train.compile_split=regions), so the backward rebuilds
    with the forward's kernels; full calls the compiled layer again. (Without train.deterministic, inductor's CPU
    kernels accumulate scatters with atomics across threads, and two runs of none differ in the last bits.) With one
    graph per layer (compile_split=layer) selective's regions are traced inside the layer and inductor fuses the
    rebuilt operations into the backward's kernels, which round differently: selective agrees with that layout's
    none to fp32 rounding, as that none agrees with the split one (other graphs sum in another order)."""
    layer = ["train.compile_split=layer"]
    extra = [("none_layer", layer), ("selective_layer", layer + ["train.recompute=selective"])]
    results = run_distributed(_policies, 1, ["train.compile=true", "train.deterministic=true"], str(tmp_path),
                              extra, POLICY_ORDER, 2, timeout=2400)
    _assert_same(results, "inductor", ("none_layer", "selective_layer"), {"selective_layer": "none_layer"})
