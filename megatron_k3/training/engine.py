"""The DeepSpeed engine: its config generated from the run config, `deepspeed.initialize` with our parallel state
as the mpu, and per-parameter (layout-independent) views of the master weights and optimizer states that
ZeRO keeps partitioned over the data-parallel group (what our checkpoints store).

What DeepSpeed does here: gradient accumulation over `num_micro` micro-batches, the data-parallel gradient
reduction (ZeRO-1: all-reduce, then each rank updates its 1/dp partition of the fp32 master weights and
optimizer states; ZeRO-2: reduce-scatter, so gradients are partitioned too), gradient clipping by the global
norm (sharded parameters counted on every tensor-parallel rank, replicated ones once: DeepSpeed reads
`tensor_model_parallel`, set by `parallel.layers.mark_sharded`), and bf16 master weights when
`precision.param_dtype=bf16`. What stays ours: tensor-parallel collectives inside the model, the LR schedule
(set on the optimizer's groups every step), the data order, metrics and the checkpoint format; with optim=muon
under ZeRO-1/2 also the Muon update and the clipping of the raw gradients before it (optim/zero.py, attached
in `initialize`), and under expert parallelism the routed experts' optimizer (`ExpertOptimizer`).
"""

from __future__ import annotations

import copy
import logging
import os

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
    optimizer of the same kind (fp32 master copies, which carry the parameters' Muon annotations: with
    optim=muon each local expert is its own matrix, as in one process): their gradients are summed over the
    expert-data-parallel group (ranks holding the same experts) and divided by the dense DP size -- each
    expert has received the tokens of every DP replica in its EP group, so the sum over EDP covers the global
    batch once -- and they are clipped by the same global norm as the dense parameters (`install_norm`),
    with the same coefficient (`optim.zero.clip_coefficient`), before the optimizer's momentum sees them."""

    def __init__(self, named_params, make_optimizer):
        from ..optim import MUON_ANNOTATIONS

        self.params = [p for _, p in named_params]
        self.names = [n for n, _ in named_params]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        for p, m in zip(self.params, self.masters):
            for k in MUON_ANNOTATIONS:
                if hasattr(p, k):
                    setattr(m, k, getattr(p, k))
        self.optimizer = make_optimizer(list(zip(self.names, self.masters)))
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
        if state.get_pipeline_model_parallel_world_size() > 1:  # every stage's experts
            dist.all_reduce(sq, group=state.get_pipeline_model_parallel_group())
        self.sq_norm = sq

    def skip(self):
        """A step skipped for non-finite gradients: drop them."""
        for m in self.masters:
            m.grad = None

    @torch.no_grad()
    def step(self, total_norm: float, clip: float):
        from ..optim.zero import clip_coefficient

        coef = clip_coefficient(total_norm, clip)  # the coefficient the dense parameters got
        if coef != 1.0:
            for m in self.masters:
                m.grad.mul_(coef)
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
    from ..optim.zero import ZeroMuon

    if isinstance(zero.optimizer, ZeroMuon):  # its step takes the norm itself (optim/zero.py)
        zero.optimizer.extra_sq_norm = lambda: experts.sq_norm.to(zero.bit16_groups[0][0].device)


def optimizer_params(optimizer) -> list:
    return [p for g in optimizer.param_groups for p in g["params"]]


def build_optimizers(model, run: RunConfig) -> tuple:
    """(the optimizer DeepSpeed wraps, ExpertOptimizer or None): `run.optim` over the dense parameters (with
    optim=muon under ZeRO-1/2 the ZeroMuon that `initialize` attaches), and under expert parallelism the same
    kind over this rank's routed experts."""
    from ..optim import build_optimizer

    o, p = run.optim, run.parallel  # optim=muon with ZeRO-0 and bf16 parameters: refused by RunConfig.validate
    named = list(model.named_parameters())
    dense = [(n, q) for n, q in named if not is_expert_parallel(q)]
    expert = [(n, q) for n, q in named if is_expert_parallel(q)]
    optimizer = build_optimizer(model, o, zero=p.zero_stage > 0, params=dense)
    experts = (ExpertOptimizer(expert, lambda ms: build_optimizer(None, o, params=ms, what="(routed experts)"))
               if expert else None)
    return optimizer, experts


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
    from ..optim.zero import ZeroMuon, attach

    if _zero_optimizer(engine) is not None and isinstance(_base_optimizer(engine), ZeroMuon):
        attach(engine)  # our Muon update and clipping of the raw gradients inside ZeRO (optim/zero.py)
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


def _group_key(group: dict, gi: int, prefix: str) -> str:
    """A group's name in the checkpoint: its rule where it has one (the same under every layout, also when the
    experts leave the dense optimizer under ep > 1), else its index."""
    return f"{prefix}.{group['rule']}" if "rule" in group else f"{prefix}.{gi}"


def _group_scalars(opt, scalar_keys, prefix) -> dict:
    out = {}
    for gi, group in enumerate(opt.param_groups):
        for q in group["params"]:
            st = opt.state.get(q)
            if st:
                out[_group_key(group, gi, prefix)] = {k: _scalar(st[k]) for k in scalar_keys if k in st}
                break
    return out


def _ensure_states(opt, keys_of: dict, scalars: dict, prefix: str) -> None:
    """Optimizer states are created lazily at the first step; build them now, shaped like the tensors they track,
    so saved values have somewhere to go: `keys_of` {id(tensor): state keys} for the tensors the checkpoint
    holds states of, which also get their group's scalars (a step count)."""
    for gi, group in enumerate(opt.param_groups):
        sc = scalars.get(_group_key(group, gi, prefix), scalars.get(f"{prefix}.{gi}", {}))
        for q in group["params"]:
            keys = keys_of.get(id(q))
            if not keys:
                continue
            st = opt.state[q]
            for k in keys:
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


MOMENTUM = "momentum_buffer"  # Muon's state key, per matrix in one process, per partition in DeepSpeed's ZeRO


class _ZeroLayout:
    """Where ZeRO-1/2 keeps each parameter: its group, the group's flat fp32 partition (the key of the torch
    optimizer's state), and for Muon groups DeepSpeed's flat momentum of whole matrices (optim/zero.py)."""

    def __init__(self, zero, base):
        self.zero, self.base = zero, base
        self.group_of = {id(q): gi for gi, g in enumerate(zero.bit16_groups) for q in g}
        self.flat = [g["params"][0] for g in base.param_groups]
        from ..optim.zero import ZeroMuon

        self.muon = {gi for gi, g in enumerate(base.param_groups)
                     if isinstance(base, ZeroMuon) and g.get("use_muon")}
        self._offsets = {}

    def elem_keys(self, gi: int) -> list:
        """The per-element states of group gi that DeepSpeed's fragments map (Muon's momentum is not one)."""
        st = self.base.state.get(self.flat[gi], {})
        return sorted(k for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0
                      and not (gi in self.muon and k == MOMENTUM))

    def offsets(self, gi: int) -> dict:
        if gi not in self._offsets:
            from ..optim.zero import momentum_offsets

            self._offsets[gi] = momentum_offsets(self.zero, gi)
        return self._offsets[gi]

    def full_momentum(self, gi: int, p) -> torch.Tensor:
        """p's whole Muon momentum, on every rank: the lowest DP rank whose partition touches p sends it
        (every such rank holds the same one); zeros before the first step."""
        group = self.zero.real_dp_process_group[gi]
        src = min(self.zero.param_to_partition_ids[gi][self.zero.get_param_id(p)])
        t = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if dist.get_rank(group) == src:
            buf = self.base.state.get(self.flat[gi], {}).get(MOMENTUM)
            if buf is not None:
                t.copy_(buf.narrow(0, self.offsets(gi)[id(p)], p.numel()).view(p.shape))
        if dist.get_world_size(group) > 1:
            dist.broadcast(t, src=dist.get_global_rank(group, src), group=group)
        return t

    def load_momentum(self, gi: int, states: dict, name_of: dict) -> None:
        """This rank's flat momentum of group gi from the per-parameter ones (absent ones: zeros)."""
        params = self.zero.params_in_partition[gi]
        if not params:
            return
        flat = self.flat[gi]
        parts = []
        for q in params:
            v = states.get(name_of[id(q)], {}).get(MOMENTUM)
            parts.append(torch.zeros(q.numel()) if v is None else v.float().flatten())
        old = self.base.state[flat].get(MOMENTUM)
        dtype = old.dtype if old is not None else torch.float32
        self.base.state[flat][MOMENTUM] = torch.cat(parts).to(device=flat.device, dtype=dtype)


def full_states(engine, named_params, experts: "ExpertOptimizer | None" = None) -> tuple:
    """({name: fp32 master weight}, {name: {state key: full tensor}}, {'dense.<rule>'|'experts.<rule>': {scalar
    key: value}}), at full size for this tensor-parallel shard: ZeRO's partitions gathered over data parallel
    (Muon's momentum, which DeepSpeed keeps per whole matrix, sent by a rank that holds it), expert-parallel
    weights gathered over the EP group (global expert order).

    Every rank must call this, in the same order everywhere (it is made of collectives)."""
    zero = _zero_optimizer(engine)
    base = _base_optimizer(engine)
    elem, scalar_keys = _state_keys(base)
    expert_names = set(experts.names) if experts is not None else set()
    weights, states = {}, {}
    if zero is not None:
        _relink(zero)
        layout = _ZeroLayout(zero, base) if hasattr(zero, "params_in_partition") else None
    for name, p in named_params:
        if name in expert_names:
            continue
        if zero is not None:
            weights[name] = p.get_full_hp_param().detach().cpu()
            if layout is None:
                states[name] = {k: p.get_full_hp_param(k).detach().cpu() for k in elem}
                continue
            gi = layout.group_of[id(p)]
            states[name] = {k: p.get_full_hp_param(k).detach().cpu() for k in layout.elem_keys(gi)}
            if gi in layout.muon:
                states[name][MOMENTUM] = layout.full_momentum(gi, p).cpu()
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
    layout = _ZeroLayout(zero, base) if zero is not None and hasattr(zero, "params_in_partition") else None
    keys_of = {}
    if zero is None:
        for name, p in named_params:
            keys_of[id(p)] = sorted(states.get(name, {}))
    elif layout is None:  # a ZeRO optimizer without per-group bookkeeping (DeepSpeed's bf16 one): one set of keys
        keys = sorted({k for name, _ in named_params for k in states.get(name, {})})
        keys_of = {id(q): keys for g in base.param_groups for q in g["params"]}
    else:
        for name, p in named_params:
            gi = layout.group_of[id(p)]
            keys = [k for k in states.get(name, {}) if not (gi in layout.muon and k == MOMENTUM)]
            flat = id(layout.flat[gi])
            keys_of[flat] = sorted(set(keys_of.get(flat, [])) | set(keys))
    _ensure_states(base, keys_of, scalars, "dense")
    if zero is not None:
        _relink(zero)
    for name, p in named_params:
        w = weights[name].to(p.device)
        if zero is not None:
            p.set_full_hp_param(w)
            gi = layout.group_of[id(p)] if layout is not None else None
            for k, v in states.get(name, {}).items():
                if not (layout is not None and gi in layout.muon and k == MOMENTUM):
                    p.set_full_hp_param(v.to(p.device), k)
        else:
            for k, v in states.get(name, {}).items():
                base.state[p][k].copy_(v.to(p.device))
        p.data.copy_(w.to(p.dtype))
    if layout is not None:
        name_of = {id(p): n for n, p in named_params}
        for gi in sorted(layout.muon):
            layout.load_momentum(gi, states, name_of)
    if experts is not None:
        e_keys = {id(m): sorted(states.get(n, {})) for n, m in zip(experts.names, experts.masters)}
        _ensure_states(experts.optimizer, e_keys, scalars, "experts")
        for name, p, m in zip(experts.names, experts.params, experts.masters):
            m.copy_(_local_experts(weights[name]).to(m.device))
            for k, v in states.get(name, {}).items():
                experts.optimizer.state[m][k].copy_(_local_experts(v).to(m.device))
            p.data.copy_(m.to(p.dtype))
