"""A dry run of a parallel layout in one process: every rank builds its part of the model on the meta device, with
torch's fake process-group backend standing in for the world (tools/build_rank.py, docs/scale.md).

Each rank does what a run does before its first allocation: a process group of `world` ranks in which it is
`rank` (the fake backend: collectives return at once and move no data), the parallel state (the rank grid and
every group, with the layout's checks), and `parallel.build_model` on the meta device (its pipeline stage, its
tensor-parallel shards, its block of experts). What it built is then read off: the layers it holds, routed
experts per MoE layer, parameter elements, and the block of the full tensor each parameter is. Over all ranks
the blocks of each parameter must tile it (identical blocks are replicas, the others disjoint), and the elements
covered, each counted once, must be the model's total (planning.params.count_parameters); each rank's count must be
the planner's for its stage (planning.planner.plan_training's `stage_params`).

`materialize_rank` goes on for one rank: allocation on the CPU (bf16 by default), shard-local initialisation and,
optionally, one forward and backward of one micro-batch under the fake backend, whose collectives leave their
outputs as allocated: the values are meaningless, the shapes and so the memory are the rank's. Memory is measured
by planning.measure.LiveTensorMemory (live tensor bytes) and the process's peak RSS, beside the planner's figures
for the same phase.
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist

from ..annotations import full_shape, shard_offsets
from ..model import causal_lm_class
from ..parallel import ParallelGroups, build_model, state, tiling
from ..parallel.pipeline import pack, unpack
from ..parallel.recompute import Policy
from ..parallel.recompute import apply as apply_recompute
from ..peft import FrozenExperts, apply_lora
from ..peft.experts import MATRICES
from ..precision import forward_context, prepare_model_for_precision
from .measure import LiveTensorMemory
from .memory import GB, training_memory
from .params import count_parameters
from .planner import plan_training
from .run import layout, resolve_recompute, workload

__all__ = ["fake_rank", "RankBuild", "build_rank", "dry_run", "plan_run", "materialize_rank"]


@contextlib.contextmanager
def fake_rank(run, world: int, rank: int):
    """Rank `rank` of a fake world of `world` ranks with its parallel state (yielded); torn down on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("a dry run stands in for the world with a fake process group: run it in a process "
                           "without torch.distributed initialised")
    if not 0 <= rank < world:
        raise ValueError(f"--rank {rank}: the world has ranks 0..{world - 1}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield state.initialize_from_config(run)
    finally:
        state.destroy_model_parallel()
        dist.destroy_process_group()


def _coords(ps) -> dict:
    return {"rank": ps.rank, "pp_rank": ps.rank_in("pp"), "tp_rank": ps.rank_in("tp"), "ep_rank": ps.rank_in("ep"),
            "dp_rank": ps.rank_in("dp"), "cp_rank": ps.rank_in("cp"), "edp_rank": ps.rank_in("edp")}


@dataclass
class RankBuild:
    """What one rank built."""
    coords: dict
    layers: list  # global indices of the decoder layers held
    experts: int  # routed experts per MoE layer held (0: no MoE layer on this rank)
    params: int  # parameter elements held (a tied tensor once; peft=lora: the frozen MXFP4 experts' too)
    blocks: dict = field(repr=False, default_factory=dict)  # name -> (full shape, offsets, shape)
    trainable: int = 0  # elements that take gradients (peft=lora: the adapters)

    def as_dict(self, planned: int | None = None, planned_trainable: int | None = None) -> dict:
        out = {**self.coords, "layers": self.layers, "experts": self.experts, "params": self.params,
               "trainable_params": self.trainable, "frozen_params": self.params - self.trainable}
        if planned is not None:
            out["planned_params"] = planned
        if planned_trainable is not None:
            out["planned_trainable_params"] = planned_trainable
        return out


def _frozen_experts(model) -> dict:
    """{name of the matrix: (full shape, offsets, shape)} of every frozen MXFP4 expert matrix (peft=lora), as the
    decoded [E, O, K] tensor it stands for."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, FrozenExperts):
            for n in MATRICES:
                E, O, K = m.packed(n).shape
                out[f"{name}.{n}"] = ((m.num_experts, O, K), (m.expert_offset, 0, 0), (E, O, K))
    return out


def _read(model, coords) -> RankBuild:
    blocks, params, trainable = {}, 0, 0
    for name, p in model.named_parameters():
        blocks[name] = (full_shape(p), shard_offsets(p), tuple(p.shape))
        params += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    frozen = _frozen_experts(model)
    blocks.update(frozen)
    params += sum(math.prod(shape) for _, _, shape in frozen.values())
    moe = model.moe_layers()
    return RankBuild(coords, model.model.layers.indices(), moe[0].experts.num_local if moe else 0, params, blocks,
                     trainable)


def _built(run, ps, device="meta", dtype=None, seed=None):
    """This rank's model as a run builds it: parallel.build_model, and under peft=lora the adapters (the frozen base,
    its experts as MXFP4 codes)."""
    groups = ParallelGroups.from_state(ps, run.parallel.sequence_parallel)
    model = build_model(run.model, groups, device, dtype, seed)
    if run.peft.enabled:
        apply_lora(model, run.peft, groups.tp, run.train.seed, whole=ps.size("pp") == 1)
    return model


def build_rank(run, world: int, rank: int) -> RankBuild:
    """Rank `rank` of `world` built on the meta device, as a run builds it."""
    with fake_rank(run, world, rank) as ps:
        return _read(_built(run, ps), _coords(ps))


def _coverage(builds, full_model) -> tuple:
    """(elements covered, each once; problems): every parameter of the full model tiled by the ranks' blocks."""
    per_name: dict = {}
    for b in builds:
        for name, (full, offsets, shape) in b.blocks.items():
            per_name.setdefault(name, (full, set()))[1].add((offsets, shape))
    problems, covered = [], 0
    for name, (full, blocks) in per_name.items():
        if name not in full_model:
            problems.append(f"{name}: not a parameter of the model")
            continue
        if tuple(full_model[name]) != tuple(full):
            problems.append(f"{name}: full shape {full}, the model's is {tuple(full_model[name])}")
        shapes = {s for _, s in blocks}
        if len(shapes) != 1 or any(o % s for offsets, s in blocks for o, s in zip(offsets, s)):
            problems.append(f"{name}: blocks of unequal shapes or unaligned offsets {sorted(blocks)[:4]}")
            continue
        n = len(blocks) * math.prod(next(iter(shapes)))  # equal aligned blocks: distinct ones are disjoint
        if n != math.prod(full):
            problems.append(f"{name}: the ranks hold {n} of its {math.prod(full)} elements")
        covered += n
    problems += [f"{name}: held by no rank" for name in full_model if name not in per_name]
    return covered, problems


def _full_shapes(run) -> dict:
    """{name: full shape} of the single-device model's parameters (under peft=lora adapted: the adapters, the frozen
    dense weights, and the MXFP4 experts as the matrices they decode to)."""
    cfg = run.model
    with torch.device("meta"):
        model = causal_lm_class(cfg)(cfg, init=False)
    if run.peft.enabled:
        apply_lora(model, run.peft)
    out = {n: tuple(p.shape) for n, p in model.named_parameters()}
    out.update({n: full for n, (full, _, _) in _frozen_experts(model).items()})
    return out


def dry_run(run, world: int, ranks=None, recompute: str = "auto", progress=None) -> dict:
    """Build `ranks` (default: all) of `world` on the meta device; the report tools/build_rank.py prints (JSON
    fields in docs/scale.md). With all ranks: `covered_params` and the check against the model's total."""
    plan = plan_run(run, world, recompute)
    ranks = range(world) if ranks is None else ranks
    t0 = time.perf_counter()
    builds, out = [], []
    for i, r in enumerate(ranks):
        b = build_rank(run, world, r)
        builds.append(b)
        s = b.coords["pp_rank"]
        out.append(b.as_dict(plan.stage_params[s], plan.stage_trainable[s]))
        if progress is not None:
            progress(i + 1, len(ranks))
    report = {
        "model": run.model.name, "cluster": run.cluster.name, "world": world,
        "layout": plan.layout.as_dict(), "planner": _plan_summary(plan),
        "ranks": out,
        "params_match_planner": all(e["params"] == e["planned_params"]
                                    and e["trainable_params"] == e["planned_trainable_params"] for e in out),
        "build_seconds": round(time.perf_counter() - t0, 2),
    }
    if len(out) == world:
        shapes = _full_shapes(run)
        total = count_parameters(run.model)["total"] + (plan.peft["trainable_params"] if plan.peft else 0)
        covered, problems = _coverage(builds, shapes)
        report.update({"covered_params": covered, "total_params": total,
                       "covered_equals_total": covered == total and not problems,
                       "coverage_problems": problems[:20]})
        if plan.peft:
            report["adapter_params"] = plan.peft["trainable_params"]
    return report


def plan_run(run, world: int, recompute: str = "auto"):
    """The planner's plan of this run's layout (recompute auto: the least recomputation that fits, as the trainer
    resolves train.recompute=auto; its choice is `plan.layout.recompute`)."""
    w = workload(run)
    return plan_training(run.model, run.cluster, layout(run, world, resolve_recompute(run, world, w, recompute)), w)


def _plan_summary(plan) -> dict:
    return {"fits": plan.fits, "recompute": plan.layout.recompute,
            "memory_per_device_gb": round(plan.memory_per_device / GB, 3),
            "memory_breakdown_gb": {k: round(v, 3) for k, v in plan.memory_breakdown.items()},
            "stage_memory_gb": plan.stage_memory_gb, "stage_params": plan.stage_params,
            "device_memory_gb": plan.capacity_gb}


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class Materialized:
    coords: dict
    layers: list
    experts: int
    params: int
    dtype: str
    init_seconds: float
    build_live_peak_bytes: int  # during construction + materialisation + initialisation
    weights_bytes: int  # live after initialisation (parameters and buffers)
    largest_allocation_bytes: int  # the largest single tensor allocated while building and initialising
    largest_param_bytes: int
    step: dict | None = None  # forward + backward of one micro-batch
    rss_peak_bytes: int = 0
    rss_start_bytes: int = 0
    planner: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)


class _Largest(LiveTensorMemory):
    """LiveTensorMemory that also keeps the largest single storage it saw created."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def track(self, t):
        if isinstance(t, torch.Tensor) and not t.is_meta:
            key = t.untyped_storage()._cdata
            if key not in self.live:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        super().track(t)


def _stage_input(run, model, start: int, tokens, dtype) -> torch.Tensor:
    """The packed ResidualState a stage after the first receives: [N, B, T, D]."""
    cfg = run.model
    n = (start // cfg.attn_res_block_size + 1) if cfg.attn_res else 1
    B, T = tokens
    return torch.randn(n, B, T, cfg.hidden_size, dtype=dtype).requires_grad_()


def materialize_rank(run, world: int, rank: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     step: bool = True, recompute: str = "none") -> Materialized:
    """Rank `rank` of `world` allocated on the CPU in `dtype`, initialised from `seed` and, with `step`, one
    forward and backward of train.micro_batch_size x train.seq_length tokens under the trainer's activation
    recomputation `recompute` (with the run's train.recompute_modules / recompute_num_layers, train.tile_tokens and
    train.offload_buffer_gb), with every gradient already held, as from a step's second micro-batch on (what the
    planner's figure counts); memory measured throughout (the offloaded layer inputs' host copies are counted as host
    memory, `host_peak_bytes`, not in the step's device peak)."""
    torch.manual_seed(seed)
    rss0 = _rss_bytes()
    with fake_rank(run, world, rank) as ps:
        tracker = _Largest()
        t0 = time.perf_counter()
        with tracker:
            tracker.phase = "build"
            model = _built(run, ps, "cpu", dtype, seed)
        init_s = time.perf_counter() - t0
        built = _read(model, _coords(ps))
        largest_param = max(p.numel() * p.element_size() for p in model.parameters())
        m = Materialized(built.coords, built.layers, built.experts, built.params, str(dtype).replace("torch.", ""),
                         round(init_s, 2), tracker.peak, tracker.current, tracker.largest, largest_param)
        if step:
            prepare_model_for_precision(model, run.precision, "cpu")  # precision=mx_qat: the experts' QAT hooks
            lay = layout(run, world, recompute)  # the trainer's policy, tiling and offload, as the Trainer applies them
            apply_recompute(model, Policy(recompute, lay.recompute_modules, lay.recompute_num_layers,
                                          int(lay.offload_bytes)))
            tiling.apply(model, lay.tile_tokens, run.model.moe_overflow)
            off = getattr(model, "host_offload", None)
            if off is not None:  # the host copies are host memory: counted apart from the device peak
                off.host_context = tracker.host_allocations
            m.step = _step(run, model, ps, tracker, dtype)
            if off is not None:
                m.step["offloaded_peak_bytes"] = off.peak
                m.step["host_peak_bytes"] = tracker.host_peak
    m.rss_peak_bytes, m.rss_start_bytes = _peak_rss_bytes(), rss0
    return m


def _step(run, model, ps, tracker, dtype) -> dict:
    t = run.train
    B, T = t.micro_batch_size, t.seq_length
    cp = ps.size("cp")
    first, last = model.model.embed_tokens is not None, model.lm_head is not None
    start = model.model.layers.indices()[0] if len(model.model.layers) else 0
    # the whole sequence, as the Trainer feeds every CP rank: context parallelism's pre-hook takes this rank's share
    # (a stage after the first gets its share of the state between stages, and the ids only for their length)
    ids = torch.randint(0, run.model.vocab_size, (B, T))
    model.train()
    with tracker:  # the gradients a step holds from its second micro-batch on (the planner's figure counts them)
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    tracker.reset_peak()
    t0 = time.perf_counter()
    with tracker:
        tracker.phase = "forward"
        x = None if first else _stage_input(run, model, start, (B, T // cp), dtype)
        state_in = None if x is None else unpack(x, run.model.attn_res)
        with forward_context(run.precision, "cpu"):  # the Trainer's forward: autocast, as the precision has it
            out = model(ids if first or cp > 1 else None, labels=ids if last else None, state_in=state_in)
        tracker.phase = "backward"
        # what the Trainer's backward has: the loss (or the stage's output) alone, not the model's output with the
        # logits
        y = out.loss if last else pack(out)
        del out
        y.backward(None if last else torch.randn_like(y))
        del y
    seconds = time.perf_counter() - t0
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return {"tokens": B * T, "live_peak_bytes": tracker.peak, "peak_phase": tracker.peak_phase,
            "grads_bytes": grads, "seconds": round(seconds, 2)}


def planner_step_memory(run, world: int, stage: int, recompute: str = "none") -> dict:
    """The planner's figures for what `materialize_rank` runs on one device of pipeline stage `stage`: weights and
    gradients in the parameters' dtype (bf16: no fp32 accumulation buffer, as plain autograd keeps them), no
    optimizer (no step is taken), one micro-batch's activations and the transients, eager kernels (the torch paths
    that run on the CPU). Also the planner's whole per-device figure for the run (optimizer, reserved, all
    micro-batches in flight) for reference."""
    # adamw: no Newton-Schulz workspace among the transients (no step taken); no image share: the step feeds token
    # ids only (the vision tower's weights and gradients still count); the run's MoE dispatch (balanced: its replica
    # slots and exchange buffers) as it runs
    w_step = replace(workload(run, kernels="eager"), optimizer="adamw", grad_dtype="bf16", image_share=0.0,
                     reduced=False)
    lay = layout(run, world, recompute)
    s = training_memory(run.model, run.cluster, lay, w_step)[stage]
    acts_one = s.activations / s.in_flight
    step_bytes = s.weights + s.gradients + acts_one + s.transient
    full = training_memory(run.model, run.cluster, lay, workload(run))[stage]
    return {"weights_bytes": s.weights, "gradients_bytes": s.gradients, "activations_one_micro_bytes": acts_one,
            "transient_bytes": s.transient, "step_bytes": step_bytes, "params": s.params_dense + s.params_experts,
            "per_device_total_bytes": full.total, "per_device_breakdown_gb": full.breakdown_gb()}
