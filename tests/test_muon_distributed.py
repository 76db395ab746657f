"""Per-Head Muon under DeepSpeed ZeRO-1 (dp=2) and under tensor parallelism (tp=2) steps exactly like one
process: parameters after 3 steps of the same global batch, fp32, gloo workers. QK-Clip is on with a
threshold the tiny model exceeds, so clipped heads take the same path too.

Tolerance: 1e-5 relative per tensor, max|a - b| / max|b|, as tests/test_tensor_parallel.py.
- dp=2: averaging two gradients is exact in fp32, so ZeRO-1 matches one process bit for bit (any seed).
- tp=2: gradients differ from one process in summation order (~1e-6). Muon matrices stay within ~1e-6
  after 3 steps (measured over 30 seeds). The AdamW half does not: AdamW divides each element by its own
  gradient scale, so an element whose gradient sits at the noise floor (embedding and LM-head entries, the
  zero-initialised AttnRes queries) takes an O(lr) different step, and the next forward carries that
  everywhere; optim=adamw alone behaves the same (measured up to 4e-4 after 3 steps). The tp=2 test
  therefore steps the Muon half only (AdamW groups at lr 0), which is what tensor parallelism changes.
- bf16 weights, fp32 accumulation (precision.grad_accum_dtype=fp32), ZeRO-1 and ZeRO-2, dp=1 and dp=2: the gradient
  of a step of 8 micro-batches per rank that the Muon update and the AdamW half receive is the fp32 sum of the
  micro-batches' bf16 gradients (within 1e-7 of their float64 sum), where DeepSpeed's own reduction dtype and Muon
  gradient buffer give 1.7e-3 (ZeRO-1) and 3.7e-3 (ZeRO-2, growing with the micro-batches: bench/RESULTS.md).
- Muon's fp32 momentum is written in place: DeepSpeed's staged copy of it is never made.
"""

from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from helpers import FAST, load_file, max_abs_rel

from megatron_k3.annotations import meta
from megatron_k3.config import OptimConfig, load_model_config
from megatron_k3.model import K3ForCausalLM
from megatron_k3.optim import Muon, build_optimizer
from megatron_k3.optim.grouping import muon_rule
from megatron_k3.planning.params import model_params

OVERRIDES = ["num_layers=4", "hidden_size=64", "dense_intermediate_size=128", "attn_res_block_size=2",
             "num_shared_experts=2"]  # two fused shared experts: per-expert blocks of the shared MLP
RTOL = 1e-5
STEPS = 3
ROOT = Path(__file__).resolve().parent.parent


def _model():
    torch.manual_seed(0)
    return K3ForCausalLM(load_model_config("k3_tiny", OVERRIDES))


def _optimizer(model, per_head=True, adamw=True, zero=False, tp=None, dp_group=None):
    # The default lr; the QK-Clip threshold lies below the tiny model's max logits (about 0.1), so heads
    # are clipped at every step.
    from megatron_k3.optim.zero import ZeroMuon

    cfg = OptimConfig(name="muon", lr=3e-3, weight_decay=0.1, per_head=per_head, qk_clip=0.05, ns_dtype="fp32")
    opt = build_optimizer(model, cfg, tp=tp, dp_group=dp_group, muon_class=ZeroMuon if zero else Muon)
    if not adamw:
        for g in opt.param_groups:
            if not g["use_muon"]:
                g["lr"] = 0.0
    return opt


def _batch(rows):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 8192, (rows, 96), generator=g)
    return ids, ids.roll(-1, 1), torch.tensor([0, 20, 64, 96])


def _reference(rows, **optim):
    """One process: the mean of the per-row losses of `rows` rows (what DP ranks average), on one thread as the
    gloo workers run: a kernel's reduction order may depend on the thread count, and AdamW turns a last-bit
    difference in a near-zero gradient into an O(lr) step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_run(rows, **optim)
    finally:
        torch.set_num_threads(threads)


def _reference_run(rows, **optim):
    model = _model()
    opt = _optimizer(model, **optim)
    ids, labels, cu = _batch(rows)
    clipped = 0
    for _ in range(STEPS):
        loss = sum(model(ids[r:r + 1], labels=labels[r:r + 1], cu_seqlens=cu).loss for r in range(rows)) / rows
        loss.backward()
        opt.step()
        opt.zero_grad()
        clipped += opt.qk_clip.last_clipped_heads
    assert clipped > 0
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_close(params, ref):
    assert params.keys() == ref.keys()
    worst = max((max_abs_rel(params[n], p, floor=1e-12, float64=False), n) for n, p in ref.items())
    assert worst[0] < RTOL, worst
    model = _model()
    init = model.state_dict()
    moved = min((max_abs_rel(ref[n], init[n], floor=1e-12, float64=False), n) for n, p in model.named_parameters()
                if muon_rule(p).startswith("muon"))
    assert moved[0] > 1e-3, moved  # every Muon matrix really was updated


def _zero_worker(rank, world):
    import deepspeed
    import deepspeed.ops
    import deepspeed.runtime.zero.muon.original_muon as ds_muon

    from megatron_k3.optim.zero import attach

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # plain gloo collectives, no C++ build
    model = _model()
    optimizer = _optimizer(model, zero=True, dp_group=torch.distributed.group.WORLD)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    attach(engine)
    zero = engine.optimizer
    muon_groups = [i for i, g in enumerate(optimizer.param_groups) if g["use_muon"]]
    # some Muon matrix lies across both ranks' partitions: the assembled-matrix path is exercised
    assert any(len(ids) > 1 for i in muon_groups for ids in zero.param_to_partition_ids[i].values())

    def deepspeed_update(*args, **kwargs):
        raise AssertionError("DeepSpeed's own muon_update ran")

    ds_muon.muon_update = deepspeed_update
    ids, labels, cu = _batch(world)
    for _ in range(STEPS):
        out = engine(ids[rank:rank + 1], labels=labels[rank:rank + 1], cu_seqlens=cu)
        engine.backward(out.loss)
        engine.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_zero1_data_parallel_muon_equals_single_process():
    """dp=2, DeepSpeed ZeRO-1, the whole optimizer (Muon and AdamW halves): matrices split across the two
    partitions are assembled before Newton-Schulz and each rank keeps its slice; QK-Clip also rewrites the
    fp32 master partitions."""
    ref = _reference(2)
    for params in run_distributed(_zero_worker, 2, timeout=240):
        _assert_close(params, ref)


def _tp_worker(rank, world, per_head):
    """(the full parameters after STEPS steps, the elements of updates Muon all-gathered over TP per step)."""
    from megatron_k3.optim import muon
    from megatron_k3.parallel import ParallelGroups, parallelize, state

    ps = state.initialize_model_parallel(tp=2)
    gathered, gather = [], muon._gather_tp
    muon._gather_tp = lambda t, dim, tp: gathered.append(t.numel()) or gather(t, dim, tp)
    try:
        groups = ParallelGroups.from_state(ps)
        model = parallelize(_model(), groups)
        opt = _optimizer(model, per_head=per_head, adamw=False, tp=groups.tp, dp_group=ps.group("dp"))
        ids, labels, cu = _batch(1)
        for _ in range(STEPS):
            model(ids, labels=labels, cu_seqlens=cu).loss.backward()
            opt.step()
            opt.zero_grad()
        group = state.get_tensor_model_parallel_group()
        out = {}
        for n, p in model.named_parameters():
            t, d = p.detach(), meta(p).tp_dim
            if d is not None:
                parts = [torch.empty_like(t) for _ in range(2)]
                torch.distributed.all_gather(parts, t.contiguous(), group=group)
                t = torch.cat(parts, d)
            out[n] = t
        return out, sum(gathered) / STEPS
    finally:
        muon._gather_tp = gather
        state.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("per_head", [True, False])
def test_tensor_parallel_muon_equals_single_process(per_head):
    """tp=2: head and shared-expert blocks are local to their rank; whole-matrix updates of sharded matrices
    (and, with per_head off, of the head projections) gather the full matrix over TP. The elements gathered per step
    are the planner's `tp_gather` count (planning/params.py: its Newton-Schulz FLOPs and tp_muon_gather traffic)."""
    ref = _reference(1, per_head=per_head, adamw=False)
    planned = model_params(load_model_config("k3_tiny", OVERRIDES), 2, 1, (), per_head)
    planned = sum(g.tp_gather for g in [lp.dense for lp in planned.layers] + [planned.embedding, planned.head])
    for params, gathered in run_distributed(_tp_worker, 2, per_head, timeout=240):
        _assert_close(params, ref)
        assert gathered == planned > 0, (gathered, planned)  # the planner's rule is the optimizer's, either way


@pytest.mark.parametrize("per_head", [True, False])
def test_the_planners_newton_schulz_flops_are_a_muon_steps(per_head):
    """The FLOPs of one Muon step (FlopCounterMode over optimizer.step: its Newton-Schulz matrix products) are the
    planner's ns_flops summed over the model, exactly, with optim.per_head on (a block per head) and off (each head
    projection whole: more FLOPs; until 2026-12-06 the planner counted per-head blocks whatever the key said)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = _model()
    opt = _optimizer(model, per_head=per_head, adamw=False)
    ids, labels, cu = _batch(1)
    model(ids, labels=labels, cu_seqlens=cu).loss.backward()
    with FlopCounterMode(display=False) as counter:
        opt.step()
    mp = model_params(load_model_config("k3_tiny", OVERRIDES), 1, 1, (), per_head)
    groups = [g for lp in mp.layers for g in (lp.dense, lp.experts)] + [mp.embedding, mp.head]
    assert counter.get_total_flops() == sum(g.ns_flops for g in groups) > 0
    if not per_head:
        per_head_plan = model_params(load_model_config("k3_tiny", OVERRIDES), 1, 1, (), True)
        assert counter.get_total_flops() > sum(g.ns_flops for lp in per_head_plan.layers for g in (lp.dense,
                                                                                                    lp.experts))


def test_zero_attach_takes_over_clipping_and_refuses_what_it_cannot_do_exactly():
    """DeepSpeed would clip the orthogonalised update, not the gradient: attach() switches DeepSpeed's clipping
    off and clips the raw gradients itself (tests/test_muon_train.py checks the result against plain Muon);
    CPU offload (DeepSpeed's own Muon update) is refused; and a ZeroMuon stepping flat ZeRO partitions without
    attach() fails instead of applying raw gradients."""
    from types import SimpleNamespace

    from megatron_k3.optim.zero import ZeroMuon, attach, clip_coefficient

    model = _model()
    opt = _optimizer(model, zero=True)
    assert isinstance(opt, ZeroMuon)
    zero = SimpleNamespace(optimizer=opt, get_flat_partition=None, all_grad_tensors={}, cpu_offload=False,
                           clip_grad=1.0, step=None)
    assert attach(SimpleNamespace(optimizer=zero, gradient_clipping=lambda: 1.0)) is opt
    assert opt.attached and opt.clip == 1.0 and zero.clip_grad == 0.0
    assert clip_coefficient(4.0, 1.0) == pytest.approx(0.25, rel=1e-6) and clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(4.0, 0.0) == 1.0
    offload = SimpleNamespace(optimizer=_optimizer(_model(), zero=True), get_flat_partition=None, all_grad_tensors={},
                              cpu_offload=True)
    with pytest.raises(NotImplementedError, match="offload"):
        attach(SimpleNamespace(optimizer=offload))
    with pytest.raises(TypeError):
        attach(SimpleNamespace(optimizer=SimpleNamespace(optimizer=torch.optim.SGD(model.parameters(), lr=1.0))))
    flat = torch.nn.Parameter(torch.zeros(10))
    flat.grad = torch.ones(10)
    bare = ZeroMuon([{"params": [flat], "use_muon": True, "layout": "matrix", "lr": 0.1, "weight_decay": 0.0,
                      "momentum": 0.95, "nesterov": True, "ns_steps": 5, "scale": 0.2, "ns_dtype": "fp32"}])
    with pytest.raises(RuntimeError, match="attach"):
        bare.step()


def _accumulation_worker(rank, world):
    """{(stage, ours): (worst relative error of a Muon matrix's step gradient, of an AdamW group's partition)} on this
    rank over 8 micro-batches per rank (bench/zero_grad_accumulation.py's setups and reference)."""
    bench = load_file(ROOT / "bench" / "zero_grad_accumulation.py")
    torch.set_num_threads(1)
    ref, out = bench.reference(8, world), {}
    for stage in (1, 2):
        for ours in (False, True):
            muon, adamw = bench.errors(ref, *bench.zero_gradients(8, stage, ours, rank, world))
            out[stage, ours] = (max(muon), max(adamw))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_bf16_weights_gradients_reach_the_optimizer_summed_in_fp32(world):
    for rank, got in enumerate(run_distributed(_accumulation_worker, world)):
        for stage in (1, 2):
            assert max(got[stage, True]) < 1e-7, (rank, stage, got)
            assert got[stage, False][0] > 1e-3, (rank, stage, got)  # DeepSpeed's own: Muon sums rounded to bf16
        assert got[1, False][1] > 1e-3, (rank, got)  # and ZeRO-1's reduction in bf16


@pytest.mark.slow
def test_muon_momentum_is_written_in_place_with_no_staged_copy(tmp_path):
    """DeepSpeed 0.19.8 stages Muon's momentum in a second momentum-sized buffer per Muon group, kept across steps
    (`_muon_staging_momentum` / `_muon_pending_momentum`), which the planner does not count; optim.zero's
    `_momentum_in_place` writes the committed fp32 momentum itself. After two Trainer steps under bf16 weights no
    staged buffer exists, and the committed momentum moved (the update wrote it). Under DeepSpeed's own staging each
    Muon group would hold one (the control below)."""
    from megatron_k3.config import compose_run_config
    from megatron_k3.training.engine import shutdown
    from megatron_k3.training.loop import Trainer

    run, _, _ = compose_run_config(FAST + ["optim=muon", "precision=bf16"])
    try:
        trainer = Trainer(run, tmp_path)
        zero = trainer.engine.optimizer
        trainer.train_step()
        first = {id(k): s["momentum_buffer"].clone() for k, s in zero.optimizer.state.items()
                 if "momentum_buffer" in s}
        trainer.train_step()
        assert first and zero._muon_pending_momentum == {}
        for k, s in zero.optimizer.state.items():
            if "momentum_buffer" in s:
                m = s["momentum_buffer"]
                assert m.dtype == torch.float32 and not torch.equal(m, first[id(k)])
        # the control: DeepSpeed's own staging makes a separate buffer for the group it is asked about
        flat, state = next((k, s) for k, s in zero.optimizer.state.items() if "momentum_buffer" in s)
        staged = type(zero)._muon_staging_momentum(zero, flat, 0)
        assert staged.untyped_storage().data_ptr() != state["momentum_buffer"].untyped_storage().data_ptr()
    finally:
        shutdown()
