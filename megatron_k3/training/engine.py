"""The DeepSpeed engine: its config generated from the run config, the optimizers it wraps, and
`deepspeed.initialize` with our parallel state as the mpu. (Per-parameter views of the states ZeRO partitions:
checkpoint/deepspeed_state.py; the routed experts' optimizer under expert parallelism: expert_optimizer.py.)

What DeepSpeed does here: gradient accumulation over `num_micro` micro-batches, the data-parallel gradient
reduction (ZeRO-1: all-reduce, then each rank updates its 1/dp partition of the fp32 master weights and
optimizer states; ZeRO-2: reduce-scatter, so gradients are partitioned too), gradient clipping by the global
norm (sharded parameters counted on every tensor-parallel rank, replicated ones once: DeepSpeed reads
`tensor_model_parallel`, which annotations.annotate derives from a parameter's split), and bf16 master weights when
`precision.param_dtype=bf16`. What stays ours: tensor-parallel collectives inside the model, the LR schedule
(set on the optimizer's groups every step), the data order, metrics and the checkpoint format; with optim=muon
under ZeRO-1/2 also the Muon update and the clipping of the raw gradients before it (optim/zero.py, attached
in `initialize`), and under expert parallelism the routed experts' optimizer (`ExpertOptimizer`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import groups as ds_groups

from ..annotations import meta
from ..config import ConfigError, RunConfig
from ..layout import ZERO_BUCKET, zero_bucket_elements
from ..ops.numerics import sq_norm64
from ..optim import Muon, build_optimizer
from ..optim.zero import ZeroMuon, attach, install_global_norm
from ..parallel import state
from ..parallel.agree import gather
from ..parallel.balanced import flush_replica_gradients
from ..parallel.mappings import Group
from ..parallel.mpu import get_mpu
from .compile import restore_determinism
from .expert_optimizer import ExpertOptimizer

log = logging.getLogger("megatron_k3.engine")

ZERO_STAGES = (0, 1, 2)
# fp32 buffers that DeepSpeed's bf16 mode (module.bfloat16()) would otherwise round: the router's selection
# bias is updated by small steps every iteration and must not lose them.
FP32_BUFFERS = ("e_score_correction_bias", "tokens_per_expert_E")


def ensure_distributed(backend: str = "gloo") -> None:
    """DeepSpeed needs a process group even for one process: make a one-rank group on an in-process store (no
    port: a free-port search can race, and an inherited MASTER_PORT may be taken by the process that set it)."""
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed insists on it; launchers set it
    if dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("WORLD_SIZE > 1 but torch.distributed is not initialised (launch through "
                           "megatron_k3.train, or call init_process_group first)")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def shutdown() -> None:
    """Forget the parallel state and DeepSpeed's cached groups and put back the determinism settings
    train.deterministic replaced, so a later run in the same process (tests, notebooks) starts clean. The process
    group itself is left to whoever created it."""
    restore_determinism()
    if state.model_parallel_is_initialized():
        state.destroy_model_parallel()
    groups = ds_groups
    for name in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP",
                 "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
                 "_MPU_TENSOR_MODEL_PARALLEL_RANK", "mpu", "_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS",
                 "_EXPERT_DATA_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
        if hasattr(groups, name):
            setattr(groups, name, {} if isinstance(getattr(groups, name), dict) else None)


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def deepspeed_config(run: RunConfig, dp: int, num_params: int | None = None) -> dict:
    """The DeepSpeed JSON config of a run (`parallel.deepspeed` entries are merged over it, for knobs we leave to
    DeepSpeed: bucket sizes, ...; RunConfig refuses an entry that contradicts a key of ours). DeepSpeed checks
    train_batch = micro_batch * grad_accum * dp."""
    t, p = run.train, run.parallel
    if p.zero_stage not in ZERO_STAGES:
        raise ConfigError("parallel.zero_stage", p.zero_stage,
                          "valid: 0, 1, 2 (ZeRO-3 partitions parameters, which the tensor/expert-parallel layers "
                          "already shard themselves)")
    bf16 = run.precision.param_dtype == "bf16"
    bucket = zero_bucket_elements(num_params) if num_params else ZERO_BUCKET  # the planner counts it (memory.py)
    cfg = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.global_batch_size // (t.micro_batch_size * dp),
        "gradient_clipping": float(t.grad_clip),
        "steps_per_print": 2 ** 31 - 1,  # we log
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,  # our optimizers are plain torch.optim ones
        # buckets no larger than the model: DeepSpeed allocates them whole (200 MB each at fp32 otherwise)
        "zero_optimization": {"stage": p.zero_stage, "contiguous_gradients": True,
                              "overlap_comm": bool(p.overlap_grad_reduce),
                              "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
        "bf16": {"enabled": bf16},
    }
    if bf16:  # precision.grad_accum_dtype: fp32 (the default, as Megatron) or bf16
        cfg["data_types"] = {"grad_accum_dtype": run.precision.grad_accum_dtype}
        # the gradient reduction in the same dtype (DeepSpeed reduces in the weights' dtype otherwise, which rounds
        # the fp32 sums to bf16 once per step under ZeRO-1; Megatron reduces its fp32 main_grad); the planner counts
        # the reduction's bytes at precision.grad_accum_dtype's size
        cfg["communication_data_type"] = run.precision.grad_accum_dtype
    extra = dict(p.deepspeed or {})  # entries contradicting a key of ours: RunConfig refuses them
    return _merge(cfg, extra)


def zero_optimizer(engine) -> DeepSpeedZeroOptimizer | None:
    """The engine's ZeRO-1/2 optimizer (every ZeRO stage runs it: `initialize`), or None under ZeRO-0."""
    return engine.optimizer if isinstance(engine.optimizer, DeepSpeedZeroOptimizer) else None


def base_optimizer(engine):
    """The torch optimizer the engine steps: the one inside ZeRO's, else the engine's own."""
    zero = zero_optimizer(engine)
    return zero.optimizer if zero is not None else engine.optimizer


@torch.no_grad()
def grad_norm_without_zero(model, ps) -> float:
    """The global gradient norm DeepSpeed's ZeRO-0 path clips with but does not report: tensor-sharded parameters
    count on every TP rank (summed over the TP group of `ps`, the rank's ParallelState), replicated ones once. Call
    after the boundary backward. The sums stay on the parameters' device (NCCL all-reduces device tensors only; a
    host copy per parameter would wait for the device each time)."""
    device = next((p.device for p in model.parameters()), None)
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for p in model.parameters():
        if p.grad is not None:
            sq = sq_norm64(p.grad)
            if meta(p).tp_dim is not None:
                sharded += sq
            else:
                replicated += sq
    if ps.size("tp") > 1:
        dist.all_reduce(sharded, group=ps.group("tp"))
    return float((sharded + replicated).sqrt())


def is_expert_parallel(p) -> bool:
    return meta(p).expert_parallel


def optimizer_params(optimizer) -> list:
    return [p for g in optimizer.param_groups for p in g["params"]]


def build_optimizers(model, run: RunConfig, ps) -> tuple:
    """(the optimizer DeepSpeed wraps, ExpertOptimizer or None): `run.optim` over the dense parameters (with
    optim=muon under ZeRO-1/2 the ZeroMuon that `initialize` attaches), and under expert parallelism the same
    kind over this rank's routed experts. `ps`: the rank's parallel.state.ParallelState."""
    o, p = run.optim, run.parallel  # optim=muon with ZeRO-0 and bf16 parameters: refused by RunConfig.validate
    tp = Group(ps.group("tp"), ps.size("tp"), ps.rank_in("tp"))
    named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]  # frozen (peft=lora's base): none
    dense = [(n, q) for n, q in named if not is_expert_parallel(q)]
    expert = [(n, q) for n, q in named if is_expert_parallel(q)]
    optimizer = build_optimizer(model, o, params=dense, tp=tp, dp_group=ps.group("dp"),
                                muon_class=ZeroMuon if p.zero_stage > 0 else Muon)
    # every rank when any has trainable routed experts: a pipeline stage without MoE layers still joins the experts'
    # collectives (their gradient norm is summed over the pipeline group), with nothing to step
    anywhere = p.ep > 1 and any(gather(bool(expert)))
    device = next(model.parameters()).device
    experts = (ExpertOptimizer(expert, lambda ms: build_optimizer(None, o, params=ms, what="(routed experts)", tp=tp),
                               ps, device, fp32_accumulation=run.precision.grad_accum_dtype == "fp32")
               if anywhere else None)
    return optimizer, experts


class _TestedHere(logging.Filter):
    """Drops DeepSpeed's "You are using ZeRO with an untested optimizer" warning: DeepSpeed has not tested our
    optimizers (torch.optim ones: AdamW, Per-Head Muon), this project's tests run them under every ZeRO stage
    against the single process (tests/test_engine.py, tests/test_muon_train.py)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "untested optimizer" not in record.getMessage()


@contextlib.contextmanager
def _zero_optimizer_for_every_stage():
    """Within: DeepSpeed wraps the client optimizer in its ZeRO-1/2 optimizer (stage_1_and_2.py) whenever ZeRO is
    on. DeepSpeed 0.19.8 otherwise hands ZeRO-1 with bf16 parameters and fp32 gradient accumulation to its
    BF16_Optimizer, which refuses Muon under model or expert parallelism and has none of the Muon plumbing
    optim/zero.py attaches to. The ZeRO-1/2 optimizer accumulates micro-batch gradients in fp32 there too (its
    `grad_accum` attribute, the path DeepSpeed itself takes for ZeRO-1 + bf16 with CPU offload), so every
    precision and optimizer runs on one ZeRO implementation."""
    check = DeepSpeedEngine._do_optimizer_sanity_check

    def zero_whenever_enabled(engine, basic_optimizer):
        wrapper = check(engine, basic_optimizer)
        return ZERO_OPTIMIZATION if engine.zero_optimization() else wrapper

    DeepSpeedEngine._do_optimizer_sanity_check = zero_whenever_enabled
    try:
        yield
    finally:
        DeepSpeedEngine._do_optimizer_sanity_check = check


def initialize(model, optimizer, run: RunConfig, ps):
    """`deepspeed.initialize` with our mpu (parallel/mpu.py: the adapter through which DeepSpeed reads the groups of
    `ps`, the rank's ParallelState); returns the engine. The model's fp32 buffers stay fp32, and expert-parallel
    weights keep this rank's experts (DeepSpeed broadcasts the module over data parallel)."""
    # The CPU accelerator would otherwise JIT-compile a shared-memory collective (tens of seconds) that gloo
    # does not need.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    ds_log = logging.getLogger("DeepSpeed")
    ds_log.setLevel(logging.WARNING if run.logging.level.upper() != "DEBUG" else logging.DEBUG)
    if not any(isinstance(f, _TestedHere) for f in ds_log.filters):
        ds_log.addFilter(_TestedHere())
    cfg = deepspeed_config(run, ps.size("dp"),
                           sum(p.numel() for p in optimizer_params(optimizer)))
    local_experts = {n: p.detach().clone() for n, p in model.named_parameters() if is_expert_parallel(p)}
    with _zero_optimizer_for_every_stage():
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg, mpu=get_mpu(),
                                               dist_init_required=False)
    with torch.no_grad():
        for n, p in engine.module.named_parameters():
            if n in local_experts:
                p.copy_(local_experts[n].to(p.dtype))
    for name, buf in engine.module.named_buffers():
        if name.rsplit(".", 1)[-1] in FP32_BUFFERS and buf.dtype != torch.float32:
            buf.data = buf.data.float()
    if zero_optimizer(engine) is not None:  # one norm collective whatever each stage's optimizer groups
        install_global_norm(zero_optimizer(engine))
    if zero_optimizer(engine) is not None and isinstance(base_optimizer(engine), ZeroMuon):
        attach(engine)  # our Muon update and clipping of the raw gradients inside ZeRO (optim/zero.py)
    return engine


class _no_optimizer_step:
    """Within: `optimizer.step()` does nothing (DeepSpeed still counts the step and zeroes the gradients)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def __enter__(self):
        self.optimizer.step = lambda *a, **k: None

    def __exit__(self, *exc):
        del self.optimizer.step


@contextlib.contextmanager
def _withheld(engine):
    """Within: DeepSpeed's ZeRO-1/2 step takes its overflow path (gradients dropped, nothing updated: the moments,
    the masters and, for Muon, the staged momentum stay as they were), as for a non-finite norm; without ZeRO the
    optimizer's step does nothing."""
    zero = zero_optimizer(engine)
    if zero is None:
        with _no_optimizer_step(engine.optimizer):
            yield
        return
    opt = base_optimizer(engine)

    def overflowed(partition_gradients=True):
        zero.overflow = True

    checks = zero.check_grad_overflow  # off for fp32 and bf16 weights (no loss scaling): on, for this step
    zero.check_grad_overflow, zero.check_overflow = True, overflowed
    opt.withheld = True  # ZeroMuon: its staged updates are not run (optim/zero.py)
    try:
        yield
    finally:
        del zero.check_overflow
        zero.check_grad_overflow, opt.withheld = checks, False


def pre_step_norm(engine, ps) -> float:
    """The global gradient norm the coming optimizer step will clip with, before it runs (train.guard judges it):
    ZeRO's over its reduced partitions (the routed experts' included where install_norm added them), else ours."""
    zero = zero_optimizer(engine)
    if zero is None:
        return grad_norm_without_zero(engine.module, ps)
    norm = float(zero.scaled_global_norm())
    return norm if norm >= 0 else float("nan")  # DeepSpeed's sentinel -1: non-finite


def boundary_step(engine, experts: ExpertOptimizer | None, run: RunConfig, ps, last: bool, judge=None):
    """DeepSpeed's step after a micro-batch's backward: a no-op except after the last micro-batch of the step, where
    the experts' gradients are reduced first. Returns (applied, ZeRO-0 gradient norm or None) after the last one:
    ZeRO skips a step whose global norm (experts included) is not finite; without ZeRO DeepSpeed would apply it, so
    its update is suppressed here. The experts step (or drop their gradients) likewise. `judge(norm) -> bool`
    (train.guard): called with the step's global gradient norm before the update; True withholds it."""
    if not last:
        engine.step()
        return None, None
    zero0 = run.parallel.zero_stage == 0
    flush_replica_gradients(engine.module)  # balanced dispatch: the step's replica gradients to their owners
    if experts is not None:
        experts.reduce_gradients()
    norm0 = grad_norm_without_zero(engine.module, ps) if zero0 else None
    withhold = judge is not None and judge(norm0 if zero0 else pre_step_norm(engine, ps))
    if withhold or (zero0 and not math.isfinite(norm0)):
        with _withheld(engine):
            engine.step()
    else:
        engine.step()
    applied = not withhold and (math.isfinite(norm0) if zero0 else bool(engine.was_step_applied()))
    if experts is not None:  # (ep > 1 implies ZeRO >= 1)
        if applied:
            experts.step(float(engine.get_global_grad_norm()), run.train.grad_clip)
        else:
            experts.skip()
    return applied, norm0
