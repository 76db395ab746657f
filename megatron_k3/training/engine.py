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


def deepspeed_config(run: RunConfig, dp: int) -> dict:
    """The DeepSpeed JSON config of a run (`parallel.deepspeed` entries are merged over it, for knobs we do not
    set: bucket sizes, overlap, ...). DeepSpeed checks train_batch = micro_batch * grad_accum * dp."""
    t, p = run.train, run.parallel
    if p.zero_stage not in ZERO_STAGES:
        raise ConfigError("parallel.zero_stage", p.zero_stage,
                          "valid: 0, 1, 2 (ZeRO-3 partitions parameters, which the tensor/expert-parallel layers "
                          "already shard themselves)")
    bf16 = run.precision.param_dtype == "bf16"
    cfg = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.global_batch_size // (t.micro_batch_size * dp),
        "gradient_clipping": float(t.grad_clip),
        "steps_per_print": 2 ** 31 - 1,  # we log
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,  # our optimizers are plain torch.optim ones
        "zero_optimization": {"stage": p.zero_stage, "contiguous_gradients": True, "overlap_comm": False,
                              "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000},
        "bf16": {"enabled": bf16},
    }
    if bf16:  # accumulate micro-batch gradients in fp32, as Megatron does
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    extra = dict(p.deepspeed or {})
    return _merge(cfg, extra)


def initialize(model, optimizer, run: RunConfig):
    """`deepspeed.initialize` with our mpu; returns the engine. The model's fp32 buffers stay fp32."""
    import deepspeed

    # The CPU accelerator would otherwise JIT-compile a shared-memory collective (tens of seconds) that gloo
    # does not need.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING if run.logging.level.upper() != "DEBUG" else logging.DEBUG)
    cfg = deepspeed_config(run, state.get_data_parallel_world_size())
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg, mpu=state.get_mpu(),
                                           dist_init_required=False)
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


def full_states(engine, named_params) -> tuple:
    """({name: fp32 master weight}, {name: {state key: full tensor}}, {group index: {scalar key: value}}).

    Every data-parallel rank must call this (ZeRO gathers each parameter with one all-reduce over the DP group,
    in the same order everywhere); each rank returns the full tensors of its tensor-parallel shard."""
    zero = _zero_optimizer(engine)
    base = _base_optimizer(engine)
    elem, scalar_keys = _state_keys(base)
    weights, states = {}, {}
    if zero is not None:
        _relink(zero)
    for name, p in named_params:
        if zero is not None:
            weights[name] = p.get_full_hp_param().detach().cpu()
            states[name] = {k: p.get_full_hp_param(k).detach().cpu() for k in elem} if elem else {}
        else:
            weights[name] = p.detach().float().cpu()
            st = base.state.get(p, {})
            states[name] = {k: st[k].detach().cpu() for k in elem if k in st}
    scalars = {}
    for gi, group in enumerate(base.param_groups):
        for q in group["params"]:
            st = base.state.get(q)
            if st:
                scalars[gi] = {k: _scalar(st[k]) for k in scalar_keys if k in st}
                break
    return weights, states, scalars


@torch.no_grad()
def load_full_states(engine, named_params, weights: dict, states: dict, scalars: dict) -> None:
    """Inverse of `full_states`: every rank keeps its own partition of each master weight and optimizer state, and
    the module's (possibly bf16) parameters are refreshed from the fp32 masters."""
    zero = _zero_optimizer(engine)
    base = _base_optimizer(engine)
    named_params = list(named_params)
    elem = sorted({k for st in states.values() for k in st})
    # Optimizer states are created lazily at the first step; build them now, shaped like the tensors they
    # track, so the saved values have somewhere to go.
    for gi, group in enumerate(base.param_groups):
        sc = {int(k): v for k, v in scalars.items()}.get(gi, {})
        for q in group["params"]:
            st = base.state[q]
            for k in elem:
                if k not in st:
                    st[k] = torch.zeros_like(q, memory_format=torch.preserve_format)
            for k, v in sc.items():
                st[k] = torch.tensor(float(v), dtype=torch.float32) if isinstance(v, float) else v
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
