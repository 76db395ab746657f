"""The DeepSpeed engine: its config generated from the run config, `deepspeed.initialize` with our parallel state
as the mpu, and per-parameter (layout-independent) views of the master weights and optimizer states that
ZeRO keeps partitioned over the data-parallel group (what our checkpoints store).

What DeepSpeed does here: gradient accumulation over `num_micro` micro-batches, the data-parallel gradient
reduction (ZeRO-1: all-reduce, then each rank updates its 1/dp partition of the fp32 master weights and
optimizer states; ZeRO-2: reduce-scatter, so gradients are partitioned too), gradient clipping by the global
norm (sharded parameters counted on every tensor-parallel rank, replicated ones once: DeepSpeed reads
`tensor_model_parallel`, set by `parallel.layers.mark_sharded`), and bf16 master weights when
`precision.param_dtype=bf16`. What stays ours: tensor-parallel collectives inside the model, the LR schedule
(set on the optimizer's groups every step), the data order, metrics and the checkpoint format.
"""

from __future__ import annotations

import copy
import logging
import os
import socket

import torch
import torch.distributed as dist

from ..config import ConfigError, RunConfig
from ..parallel import state

log = logging.getLogger("megatron_k3.engine")

ZERO_STAGES = (0, 1, 2)
# fp32 buffers that DeepSpeed's bf16 mode (module.bfloat16()) would otherwise round: the router's selection
# bias is updated by small steps every iteration and must not lose them.
FP32_BUFFERS = ("e_score_correction_bias", "tokens_per_expert_E")


def ensure_distributed(backend: str = "gloo") -> None:
    """DeepSpeed needs a process group even for one process: make a one-rank group on a free local port."""
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed insists on it; launchers set it
    if dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("WORLD_SIZE > 1 but torch.distributed is not initialised (launch through "
                           "megatron_k3.train, or call init_process_group first)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    dist.init_process_group(backend, rank=0, world_size=1)


def shutdown() -> None:
    """Forget the parallel state and DeepSpeed's cached groups, so a later run in the same process (tests, notebooks)
    starts clean. The process group itself is left to whoever created it."""
    from ..parallel.layers import set_sequence_parallel

    set_sequence_parallel(False)
    if state.model_parallel_is_initialized():
        state.destroy_model_parallel()
    try:
        from deepspeed.utils import groups
    except ImportError:
        return
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


BUCKET = 50_000_000  # elements per ZeRO reduce / all-gather bucket (DeepSpeed allocates one of this size)


def deepspeed_config(run: RunConfig, dp: int, num_params: int | None = None) -> dict:
    """The DeepSpeed JSON config of a run (`parallel.deepspeed` entries are merged over it, for knobs we do not
    set: bucket sizes, overlap, ...). DeepSpeed checks train_batch = micro_batch * grad_accum * dp."""
    t, p = run.train, run.parallel
    if p.zero_stage not in ZERO_STAGES:
        raise ConfigError("parallel.zero_stage", p.zero_stage,
                          "valid: 0, 1, 2 (ZeRO-3 partitions parameters, which the tensor/expert-parallel layers "
                          "already shard themselves)")
    bf16 = run.precision.param_dtype == "bf16"
    bucket = min(BUCKET, -(-(num_params or BUCKET) // 256) * 256)  # DeepSpeed wants a multiple of its alignment
    cfg = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.global_batch_size // (t.micro_batch_size * dp),
        "gradient_clipping": float(t.grad_clip),
        "steps_per_print": 2 ** 31 - 1,  # we log
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,  # our optimizers are plain torch.optim ones
        # buckets no larger than the model: DeepSpeed allocates them whole (200 MB each at fp32 otherwise)
        "zero_optimization": {"stage": p.zero_stage, "contiguous_gradients": True, "overlap_comm": False,
                              "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
        "bf16": {"enabled": bf16},
    }
    if bf16:  # accumulate micro-batch gradients in fp32, as Megatron does
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    extra = dict(p.deepspeed or {})
    return _merge(cfg, extra)


def tp_sum(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    dist.all_reduce(t, group=state.get_tensor_model_parallel_group())
    return t


@torch.no_grad()
def grad_norm_without_zero(model) -> float:
    """The global gradient norm DeepSpeed's ZeRO-0 path clips with but does not report: tensor-sharded parameters
    count on every TP rank (summed over TP), replicated ones once. Call after the boundary backward."""
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None:
            sq = p.grad.double().pow(2).sum().cpu()
            if getattr(p, "tp_split_dim", None) is not None:
                sharded += sq
            else:
                replicated += sq
    if state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(sharded, group=state.get_tensor_model_parallel_group())
    return float((sharded + replicated).sqrt())


def is_expert_parallel(p) -> bool:
    return getattr(p, "expert_parallel", False)


class ExpertOptimizer:
    """The routed experts under expert parallelism (ep > 1), outside DeepSpeed.

    DeepSpeed's ZeRO flattens and reduces every parameter it manages over the dense data-parallel group, which
    would add expert e of one EP rank to expert e + E/ep of another. So the local experts get their own
    optimizer of the same kind (fp32 master copies when the module is bf16): their gradients are summed over
    the expert-data-parallel group (ranks holding the same experts) and divided by the dense DP size -- each
    expert has received the tokens of every DP replica in its EP group, so the sum over EDP covers the global
    batch once -- and they are clipped by the same global norm as the dense parameters (`install_norm`)."""

    def __init__(self, named_params, make_optimizer):
        self.params = [p for _, p in named_params]
        self.names = [n for n, _ in named_params]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.optimizer = make_optimizer(self.masters)
        self.edp_group = state.get_expert_data_parallel_group()
        self.ep_group = state.get_expert_model_parallel_group()
        self.dp = state.get_data_parallel_world_size()
        self.sq_norm = torch.zeros((), dtype=torch.float64)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @torch.no_grad()
    def reduce_gradients(self):
        """After the last micro-batch's backward: gradients of the global batch into the fp32 masters, and
        their squared norm over every expert (summed over the EP group: each rank holds different experts)."""
        sq = torch.zeros((), dtype=torch.float64)
        for p, m in zip(self.params, self.masters):
            g = torch.zeros_like(m) if p.grad is None else p.grad.float()
            if dist.get_world_size(self.edp_group) > 1:
                dist.all_reduce(g, group=self.edp_group)
            m.grad = g.div_(self.dp)
            sq += m.grad.double().pow(2).sum().cpu()
            p.grad = None
        if dist.get_world_size(self.ep_group) > 1:
            dist.all_reduce(sq, group=self.ep_group)
        self.sq_norm = sq

    def skip(self):
        """A step skipped for non-finite gradients: drop them."""
        for m in self.masters:
            m.grad = None

    @torch.no_grad()
    def step(self, total_norm: float, clip: float):
        if clip > 0 and (total_norm + 1e-6) / clip > 1:  # the same coefficient DeepSpeed applies to the rest
            for m in self.masters:
                m.grad.mul_(clip / (total_norm + 1e-6))
        self.optimizer.step()
        for p, m in zip(self.params, self.masters):
            m.grad = None
            p.copy_(m.to(p.dtype))


def install_norm(engine, experts: ExpertOptimizer) -> None:
    """Make DeepSpeed's global gradient norm (which it clips with) include the experts outside it."""
    zero = _zero_optimizer(engine)
    inner = zero.scaled_global_norm

    def scaled_global_norm(norm_type=2):
        dense = inner(norm_type)
        return (dense.double() ** 2 + experts.sq_norm.to(dense.device)).sqrt().to(dense.dtype)

    zero.scaled_global_norm = scaled_global_norm


def optimizer_params(optimizer) -> list:
    return [p for g in optimizer.param_groups for p in g["params"]]


def initialize(model, optimizer, run: RunConfig):
    """`deepspeed.initialize` with our mpu; returns the engine. The model's fp32 buffers stay fp32, and
    expert-parallel weights keep this rank's experts (DeepSpeed broadcasts the module over data parallel)."""
    import deepspeed

    # The CPU accelerator would otherwise JIT-compile a shared-memory collective (tens of seconds) that gloo
    # does not need.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING if run.logging.level.upper() != "DEBUG" else logging.DEBUG)
    cfg = deepspeed_config(run, state.get_data_parallel_world_size(),
                           sum(p.numel() for p in optimizer_params(optimizer)))
    local_experts = {n: p.detach().clone() for n, p in model.named_parameters() if is_expert_parallel(p)}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg, mpu=state.get_mpu(),
                                           dist_init_required=False)
    with torch.no_grad():
        for n, p in engine.module.named_parameters():
            if n in local_experts:
                p.copy_(local_experts[n].to(p.dtype))
    for name, buf in engine.module.named_buffers():
        if name.rsplit(".", 1)[-1] in FP32_BUFFERS and buf.dtype != torch.float32:
            buf.data = buf.data.float()
    return engine


# ---------------------------------------------------------------------- per-parameter optimizer views


def _zero_optimizer(engine):
    opt = engine.optimizer
    return opt if hasattr(opt, "_lazy_init_hp_params_optimizer_state") or hasattr(opt, "fp32_groups_flat_partition") \
        else None


def _base_optimizer(engine):
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt) if _zero_optimizer(engine) is not None else opt


def _relink(zero) -> None:
    """Point every parameter's fragment mapping at the optimizer's current state tensors (DeepSpeed links them
    once, possibly before the first step has created them)."""
    zero._hp_optimizer_states_linked = False
    zero._lazy_init_hp_params_optimizer_state()


def _state_keys(base_opt) -> tuple:
    """(per-element state keys, scalar state keys) of the wrapped torch optimizer, from the states it holds."""
    elem, scalar = set(), set()
    for st in base_opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0:
                elem.add(k)
            else:
                scalar.add(k)
    return tuple(sorted(elem)), tuple(sorted(scalar))


def _scalar(v):
    return float(v.item()) if torch.is_tensor(v) else v


def _group_scalars(opt, scalar_keys, prefix) -> dict:
    out = {}
    for gi, group in enumerate(opt.param_groups):
        for q in group["params"]:
            st = opt.state.get(q)
            if st:
                out[f"{prefix}.{gi}"] = {k: _scalar(st[k]) for k in scalar_keys if k in st}
                break
    return out


def _ensure_states(opt, elem, scalars: dict, prefix: str) -> None:
    """Optimizer states are created lazily at the first step; build them now, shaped like the tensors they track,
    so saved values have somewhere to go."""
    for gi, group in enumerate(opt.param_groups):
        sc = scalars.get(f"{prefix}.{gi}", {})
        for q in group["params"]:
            st = opt.state[q]
            for k in elem:
                if k not in st:
                    st[k] = torch.zeros_like(q, memory_format=torch.preserve_format)
            for k, v in sc.items():
                st[k] = torch.tensor(float(v), dtype=torch.float32) if isinstance(v, float) else v


def _gather_experts(t: torch.Tensor) -> torch.Tensor:
    group = state.get_expert_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, 0)


def _local_experts(t: torch.Tensor) -> torch.Tensor:
    return t.chunk(state.get_expert_model_parallel_world_size(), 0)[state.get_expert_model_parallel_rank()]


def full_states(engine, named_params, experts: "ExpertOptimizer | None" = None) -> tuple:
    """({name: fp32 master weight}, {name: {state key: full tensor}}, {'dense.<group>'|'experts.<group>': {scalar
    key: value}}), at full size for this tensor-parallel shard: ZeRO's partitions gathered over data parallel,
    expert-parallel weights gathered over the EP group (global expert order).

    Every rank must call this, in the same order everywhere (it is made of collectives)."""
    zero = _zero_optimizer(engine)
    base = _base_optimizer(engine)
    elem, scalar_keys = _state_keys(base)
    expert_names = set(experts.names) if experts is not None else set()
    weights, states = {}, {}
    if zero is not None:
        _relink(zero)
    for name, p in named_params:
        if name in expert_names:
            continue
        if zero is not None:
            weights[name] = p.get_full_hp_param().detach().cpu()
            states[name] = {k: p.get_full_hp_param(k).detach().cpu() for k in elem} if elem else {}
        else:
            weights[name] = p.detach().float().cpu()
            st = base.state.get(p, {})
            states[name] = {k: st[k].detach().cpu() for k in elem if k in st}
    scalars = _group_scalars(base, scalar_keys, "dense")
    if experts is not None:
        e_elem, e_scalar = _state_keys(experts.optimizer)
        for name, m in zip(experts.names, experts.masters):
            weights[name] = _gather_experts(m.detach()).cpu()
            st = experts.optimizer.state.get(m, {})
            states[name] = {k: _gather_experts(st[k].detach()).cpu() for k in e_elem if k in st}
        scalars.update(_group_scalars(experts.optimizer, e_scalar, "experts"))
    return weights, states, scalars


@torch.no_grad()
def load_full_states(engine, named_params, weights: dict, states: dict, scalars: dict,
                     experts: "ExpertOptimizer | None" = None) -> None:
    """Inverse of `full_states`: every rank keeps its own partition of each master weight and optimizer state
    (and its own experts), and the module's (possibly bf16) parameters are refreshed from the fp32 masters."""
    zero = _zero_optimizer(engine)
    base = _base_optimizer(engine)
    expert_names = set(experts.names) if experts is not None else set()
    named_params = [(n, p) for n, p in named_params if n not in expert_names]
    elem = sorted({k for n, st in states.items() if n not in expert_names for k in st})
    _ensure_states(base, elem, scalars, "dense")
    if zero is not None:
        _relink(zero)
    for name, p in named_params:
        w = weights[name].to(p.device)
        if zero is not None:
            p.set_full_hp_param(w)
            for k, v in states.get(name, {}).items():
                p.set_full_hp_param(v.to(p.device), k)
        else:
            for k, v in states.get(name, {}).items():
                base.state[p][k].copy_(v.to(p.device))
        p.data.copy_(w.to(p.dtype))
    if experts is not None:
        e_elem = sorted({k for n in experts.names for k in states.get(n, {})})
        _ensure_states(experts.optimizer, e_elem, scalars, "experts")
        for name, p, m in zip(experts.names, experts.params, experts.masters):
            m.copy_(_local_experts(weights[name]).to(m.device))
            for k, v in states.get(name, {}).items():
                experts.optimizer.state[m][k].copy_(_local_experts(v).to(m.device))
            p.data.copy_(m.to(p.dtype))
