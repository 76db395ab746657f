"""Per-Head Muon under DeepSpeed ZeRO-1/2: DeepSpeed's Muon plumbing with our update plugged into it.

What DeepSpeed 0.19.8 does (deepspeed/runtime/zero/stage_1_and_2.py) when the client optimizer is a
`MuonWithAuxAdam` whose class name contains "muon" and whose matrices carry `use_muon = True`:
- reduction: a Muon matrix split across DP partitions is all-reduced instead of reduced to its owner, so
  every rank whose partition touches it holds its full averaged gradient (`average_tensor`);
- at the accumulation boundary `get_flat_partition` calls `original_muon.muon_update(grad, momentum, ...)`
  on each whole matrix of the rank's partition, with momentum in one flat buffer per group covering those
  whole matrices (staged, and committed only when the step is not skipped), and keeps only the partition's
  slice of the result, in place of the gradient;
- the client optimizer's step() then sees flat 1-D partitions and applies weight decay and the lr.
So the full matrix (or head block) is assembled before Newton-Schulz and only the local shard is kept.

What does not fit, and is replaced. DeepSpeed's update (EMA momentum, a sqrt(max(1, A/B)) scale, heads
only along rows and not at all in its padded-partition path, torch.compile'd, so a C++ build on CPU; imported here
without compiling, `_import_uncompiled`) is
called without the parameter; and DeepSpeed clips the norm of whatever holds the gradient's place, here the
orthogonalised update. `attach(engine)` therefore:
1. wraps the ZeRO optimizer's `get_flat_partition`: for a Muon group it points `original_muon.muon_update`,
   for the duration of the call, at a function that records (parameter, full gradient, momentum view) and
   hands the gradient itself back, so the partition DeepSpeed builds is a set of views of the raw gradients;
2. wraps the ZeRO optimizer's `step`: the global norm of the raw gradients is taken first (`raw_grad_sq_norm`
   over the partitions, which still hold raw gradients, in float64 so that it does not depend on the layout:
   each element counted once over DP, TP-sharded parameters on every TP rank; experts outside ZeRO added
   through `extra_sq_norm`, which `engine.install_norm` sets), the
   clipping coefficient `clip_coefficient(norm, gradient_clipping)` is applied to the gradients, then every
   recorded matrix gets `Muon.muon_update` (the single-process code: momentum, head blocks on either axis,
   experts, the TP gather, our scale) written over its gradient in place, which the partition views see;
   the AdamW groups' flat partitions are scaled by the same coefficient inside ZeroMuon's step. DeepSpeed's
   own clipping is switched off (`clip_grad = 0`), and its norm (the overflow check, `get_global_grad_norm`)
   is the raw gradients' one. This is what single-process Muon with clipping does: clip, then momentum and
   Newton-Schulz. A skipped step runs no update, so the momentum is written in place (`_momentum_in_place`:
   DeepSpeed's staged copy, committed only when the step is not skipped, is not needed);
3. runs QK-Clip after DeepSpeed has gathered the updated weights and writes the rescaled rows into the fp32
   master partitions;
4. under bf16 weights with fp32 accumulation, keeps the Muon groups' reduced gradients, ZeRO-2's buckets and so
   DeepSpeed's Muon momentum in fp32 (`_fp32_muon_gradient_buffer`; DeepSpeed keeps them in bf16).
Its config needs `zero_allow_untested_optimizer: true` (and `communication_data_type: fp32` to reduce in fp32, as
training/engine.py sets it under fp32 accumulation). CPU offload takes a different DeepSpeed path (it
orthogonalises before clipping) and is refused.

DeepSpeed keeps the momentum in `optimizer.state[flat partition]["momentum_buffer"]`: whole matrices of the
rank's partition, concatenated in `params_in_partition` order. `momentum_views` maps it to parameters, which
is how training/engine.py stores it per parameter in checkpoints.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import sys

import torch
import torch.distributed as dist
from deepspeed.runtime import compiler as ds_compiler

from ..ops.numerics import sq_norm64
from .muon import Muon


def _import_uncompiled(module: str):
    """DeepSpeed's Muon module `module`, imported with DeepSpeed's `compiler.compile()` decorator a pass-through
    while it loads. Its Newton-Schulz and update functions are `torch.compile`d at import, which costs every
    process that imports this module about 1 s of start-up (torch.compile sets up its backend when it decorates).
    Nothing here calls them: `attach` replaces `muon_update` wherever DeepSpeed would call it (asserted in
    tests/test_muon_distributed.py), and CPU offload, DeepSpeed's other caller, is refused. A process that imported
    the module before keeps its compiled functions."""
    if module in sys.modules:
        return sys.modules[module]
    saved = ds_compiler.compile
    ds_compiler.compile = lambda: ds_compiler.dummy_decorator
    try:
        return importlib.import_module(module)
    finally:
        ds_compiler.compile = saved


ds_muon = _import_uncompiled("deepspeed.runtime.zero.muon.original_muon")
MuonWithAuxAdam = _import_uncompiled("deepspeed.runtime.zero.muon.muon_optimizer").MuonWithAuxAdam


def clip_coefficient(norm: float, clip: float) -> float:
    """The factor gradients are multiplied by under global-norm clipping at `clip` (0 = off): DeepSpeed's
    clip / (norm + 1e-6) when that is below 1. One formula for the dense ZeRO path and the experts."""
    if clip > 0 and (norm + 1e-6) / clip > 1:
        return clip / (norm + 1e-6)
    return 1.0


class ZeroMuon(Muon, MuonWithAuxAdam):
    """Muon as DeepSpeed's ZeRO recognises it (a MuonWithAuxAdam, "muon" in the class name). Without ZeRO
    (stage 0) it steps exactly like Muon; under ZeRO-1/2 it needs `attach(engine)`."""

    def __init__(self, param_groups: list, tp=None, qk_clip=None):
        Muon.__init__(self, param_groups, tp, qk_clip)  # not MuonWithAuxAdam.__init__: no inner Adam
        self.aux_optimizer = None
        self.attached = False
        self.grad_scale = 1.0  # the clipping coefficient of the current step (attached only)
        self.pending = {}  # group index -> [(param, gradient, momentum view)], recorded by get_flat_partition
        # squared norm of gradients outside the ZeRO optimizer that the clipping norm includes (float64 tensor)
        self.extra_sq_norm = lambda: torch.zeros((), dtype=torch.float64)

    load_state_dict = torch.optim.Optimizer.load_state_dict  # MuonWithAuxAdam's expects its inner Adam

    def _muon_step(self, p, group):
        if p.ndim > 1:  # the weight itself: no ZeRO optimizer is in play
            return Muon._muon_step(self, p, group)
        # A flat ZeRO partition: its gradient already holds this partition's slice of muon_update.
        if not self.attached:
            raise RuntimeError("ZeroMuon is stepping flat ZeRO partitions but attach() was not called: call "
                               "megatron_k3.optim.zero.attach(engine) right after deepspeed.initialize")
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(p.grad, alpha=-group["lr"])

    def _adamw_step(self, p, group):
        if self.attached and self.grad_scale != 1.0:  # a flat partition of raw gradients: clip it here
            p.grad.mul_(self.grad_scale)
        Muon._adamw_step(self, p, group)

    def _after_step(self):
        if not self.attached:  # under ZeRO, QK-Clip waits until DeepSpeed has gathered the new weights
            Muon._after_step(self)

    @torch.no_grad()
    def run_pending_updates(self, scale: float) -> None:
        """The deferred Muon updates of this step: each recorded gradient is scaled by `scale` (clipping), fed
        to `muon_update` with its momentum view, and overwritten by the update."""
        for gi, todo in self.pending.items():
            group = self.param_groups[gi]
            for p, grad, momentum in todo:
                if scale != 1.0:
                    grad.mul_(scale)
                grad.copy_(self.muon_update(p, grad, momentum, group))
        self.pending = {}


@contextlib.contextmanager
def _muon_update_is(fn):
    saved = ds_muon.muon_update
    ds_muon.muon_update = fn  # stage_1_and_2 imports it by name from this module on every call
    try:
        yield
    finally:
        ds_muon.muon_update = saved


def _zero_and_opt(engine):
    zero = getattr(engine, "optimizer", engine)
    return zero, getattr(zero, "optimizer", None)


def attach(engine) -> ZeroMuon:
    """Route DeepSpeed ZeRO-1/2's Muon update through ours and clip the raw gradients (see the module
    docstring). `engine` is the DeepSpeedEngine from deepspeed.initialize (or its ZeRO optimizer, then the
    clipping threshold is its `clip_grad`). Returns the ZeroMuon."""
    zero, opt = _zero_and_opt(engine)
    if not isinstance(opt, ZeroMuon):
        raise TypeError(f"attach() needs the ZeroMuon from build_optimizer(model, cfg, zero=True) inside a ZeRO "
                        f"optimizer; got {type(zero).__name__} around {type(opt).__name__}")
    if not hasattr(zero, "get_flat_partition") or not hasattr(zero, "all_grad_tensors"):
        raise TypeError(f"attach() supports ZeRO stages 1 and 2; got {type(zero).__name__}")
    if getattr(zero, "cpu_offload", False):
        raise NotImplementedError("Muon with ZeRO CPU offload: DeepSpeed's offload path runs its own Muon update")
    if opt.attached:
        return opt
    clip = float(engine.gradient_clipping() if hasattr(engine, "gradient_clipping") else zero.clip_grad)
    zero.clip_grad = 0.0  # ours, before the momentum (DeepSpeed's would clip the orthogonalised update)
    opt.clip = clip
    _defer_muon_updates(zero, opt)
    _clip_raw_gradients(zero, opt, clip)
    _flush_before_muon_gradients(zero, opt)
    _fp32_muon_gradient_buffer(zero)
    _momentum_in_place(zero)
    opt.attached = True
    return opt


def _momentum_in_place(zero) -> None:
    """DeepSpeed 0.19.8 stages Muon's momentum: a step's update writes into a copy of it (`_muon_staging_momentum`,
    one more momentum-sized buffer per Muon group, kept across steps) that `_commit_muon_momentum` copies back when
    the step is not skipped. Here the update runs only in a step that is taken (`_clip_raw_gradients`: a non-finite
    norm or train.guard's withheld step runs none), so it writes the momentum itself: no second buffer (4 bytes per
    element of the rank's Muon matrices, which the planner does not count) and no copy per step."""
    if hasattr(zero, "_muon_staging_momentum"):
        zero._muon_staging_momentum = lambda flatten_copy, _: zero.optimizer.state[flatten_copy]["momentum_buffer"]


def _fp32_muon_gradient_buffer(zero) -> None:
    """Under bf16 weights with fp32 gradient accumulation (precision.grad_accum_dtype=fp32), keep the Muon matrices'
    reduced gradients in fp32, as the AdamW half's are. DeepSpeed 0.19.8 copies a reduced gradient of a Muon group
    (not in its compact fp32 partition buffer, which needs no whole matrices) into `grads_in_partition`, made in the
    weights' dtype, and points the parameter's gradient at it; under ZeRO-2, which reduces every micro-batch, the
    reduction itself runs in a bucket of the weights' dtype and writes its fp32 result back there. So under ZeRO-1
    the step's fp32 sum was rounded to bf16 once (1.7e-3 relative), under ZeRO-2 the micro-batches' sum accumulated
    in bf16 (1.3e-2 at 128 micro-batches, growing with their number; bench/zero_grad_accumulation.py). Here
    `grads_in_partition`, remade after every backward, is made in fp32 and only as large as the parameters that use
    it (the Muon groups' in this rank's partition), and ZeRO-2's buckets are fp32, as ZeRO-1's are (a gradient
    larger than a bucket, which DeepSpeed reduces where it lies, is made fp32 first). DeepSpeed's Muon momentum takes
    the gradients' dtype: it is fp32 too (it was bf16)."""
    if (getattr(zero, "gradient_accumulation_dtype", None) != torch.float32
            or getattr(zero, "dtype", torch.float32) == torch.float32 or not hasattr(zero, "copy_grads_in_partition")):
        return
    copy = zero.copy_grads_in_partition
    # fixed once DeepSpeed has partitioned the groups (the compact buffer's use depends on the dtypes and groups only)
    size = sum(p.numel() for i, group in enumerate(zero.params_in_partition)
               if not zero._use_compact_grad_partition_buffer(i) for p in group)

    def copy_grads_in_partition(param, group_idx=None):
        if zero.grads_in_partition is None:  # attach refuses CPU offload, whose path keeps no such buffer
            zero.grads_in_partition = torch.empty(size, dtype=torch.float32, device=param.device)
            zero.grads_in_partition_offset = 0
        return copy(param, group_idx)

    zero.copy_grads_in_partition = copy_grads_in_partition
    if not zero.partition_gradients:  # ZeRO-1 reduces its fp32 accumulators (grad_accum) in fp32 buckets
        return
    zero._gradient_reduction_buffer_dtype = lambda: torch.float32  # the buckets, made at each backward's first
    reduce = zero.reduce_independent_p_g_buckets_and_remove_grads

    def reduce_independent_p_g_buckets_and_remove_grads(param, i):
        grad = param.grad
        if grad is not None and grad.dtype != torch.float32 and param.numel() > zero.reduce_bucket_size:
            grad.data = grad.data.float()  # reduced in place, outside the buckets
        return reduce(param, i)

    zero.reduce_independent_p_g_buckets_and_remove_grads = reduce_independent_p_g_buckets_and_remove_grads


def _defer_muon_updates(zero, opt: ZeroMuon) -> None:
    """Wrap zero.get_flat_partition: at a Muon group's boundary, record each (parameter, gradient, momentum)
    DeepSpeed hands muon_update instead of updating there (opt.pending; the update runs in the step, after the
    clipping coefficient is known)."""
    original = zero.get_flat_partition

    def get_flat_partition(tensor_list, first_offset, partition_size, dtype, device, param_group_idx,
                           return_tensor_list=False):
        group = opt.param_groups[param_group_idx]
        args = (tensor_list, first_offset, partition_size, dtype, device, param_group_idx, return_tensor_list)
        if not group.get("use_muon") or not tensor_list:
            return original(*args)
        if not return_tensor_list:  # a flattened copy would not see the updates written later
            raise NotImplementedError("ZeroMuon defers its update and needs get_flat_partition's tensor list")
        grads = zero.all_grad_tensors[param_group_idx]
        owner = {id(g): p for p, g in zip(tensor_list, grads)}  # the gradients DeepSpeed hands muon_update
        todo = []

        def record(grad, momentum, *_, **__):
            out = grad.contiguous()  # what DeepSpeed's partition will view
            todo.append((owner[id(grad)], out, momentum))
            return out

        with _muon_update_is(record):
            out = original(*args)
        opt.pending[param_group_idx] = todo  # a second call at the same boundary (reentrant checkpointing)
        return out                           # rebuilds the partition: its records replace the first ones

    zero.get_flat_partition = get_flat_partition


def _clip_raw_gradients(zero, opt: ZeroMuon, clip: float) -> None:
    """Wrap zero.step: clip by the raw gradients' norm, run the deferred Muon updates, report that norm to
    DeepSpeed's overflow check, and apply QK-Clip to the fp32 masters."""
    original_step = zero.step

    def step(*args, **kwargs):
        if getattr(zero, "loss_scale", 1.0) != 1.0:
            raise NotImplementedError("ZeroMuon with fp16 loss scaling")
        # the Muon partitions still hold raw gradients; experts outside ZeRO: engine.install_norm
        raw = (raw_grad_sq_norm(zero) + opt.extra_sq_norm()).sqrt()
        norm = float(raw)
        opt.grad_scale = clip_coefficient(norm, clip) if math.isfinite(norm) else 1.0
        if math.isfinite(norm) and not getattr(opt, "withheld", False):  # else DeepSpeed skips the step and no
            opt.run_pending_updates(opt.grad_scale)  # momentum moves (withheld: train.guard's skip)
        opt.pending = {}
        norm_fn = zero.scaled_global_norm
        zero.scaled_global_norm = lambda norm_type=2: raw  # DeepSpeed's overflow check and reported norm
        try:
            out = original_step(*args, **kwargs)
        finally:
            zero.scaled_global_norm = norm_fn
            opt.grad_scale = 1.0
        if opt.qk_clip is not None:
            for p in opt.qk_clip.apply():
                if hasattr(p, "set_full_hp_param"):  # the fp32 master partition DeepSpeed steps from
                    p.set_full_hp_param(p.data)
        return out

    zero.step = step


def _flush_before_muon_gradients(zero, opt: ZeroMuon) -> None:
    """Reduce the pending bucket before a Muon matrix's gradient joins it when the bucket's last gradient belongs to
    an AdamW group. Under bf16 parameters with fp32 gradient accumulation DeepSpeed 0.19.8 reduces AdamW groups
    into a compact fp32 partition buffer and Muon groups (whole matrices) into another (`grads_in_partition`, fp32
    here: `_fp32_muon_gradient_buffer`); `average_tensor`
    merges a Muon slice into the preceding bucket range when both go to the same rank, and the merged range keeps
    no output buffer, so the AdamW gradient before it is reduced and then dropped (seen: every AttnRes query, short
    conv filter and most norm weights kept their initial value under ZeRO-2 + bf16 + Muon, whose buckets follow the
    backward's order). Reducing the bucket at that boundary is what DeepSpeed does when a bucket is full, so the
    two never share one."""
    if not hasattr(zero, "ipg_buckets") or not hasattr(zero, "reduce_ipg_grads"):
        return
    muon_group = [bool(g.get("use_muon")) for g in opt.param_groups]
    original = zero.reduce_independent_p_g_buckets_and_remove_grads

    def reduce_independent_p_g_buckets_and_remove_grads(param, i):
        comm_dtype = zero.get_param_comm_dtype(param)
        bucket = zero.ipg_buckets[comm_dtype]
        if muon_group[i] and bucket.params and not muon_group[bucket.params[-1][0]]:
            zero.reduce_ipg_grads(comm_dtype=comm_dtype)
            if zero.contiguous_gradients and zero.overlap_comm:
                bucket.index = 1 - bucket.index  # as DeepSpeed after reducing a full bucket
        return original(param, i)

    zero.reduce_independent_p_g_buckets_and_remove_grads = reduce_independent_p_g_buckets_and_remove_grads


@torch.no_grad()
def raw_grad_sq_norm(zero) -> torch.Tensor:
    """The squared global norm of the gradients in the ZeRO partitions, in float64: each element once over data
    parallelism (every rank sums its partition's slices), tensor-parallel shards on every model-parallel rank
    and replicated parameters on its rank 0 (DeepSpeed's `get_grad_norm_direct` rule). fp32 squares are exact in
    float64 and their sum is rounded at 1e-16, so the norm, and the clipping coefficient taken from it, do not
    depend on how the data-parallel partitions cut the parameters."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    device = zero.bit16_groups[0][0].device
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(len(zero.bit16_groups)):
        grads = [g for g in zero.averaged_gradients[i] or [] if not getattr(g, "_zero_padding", False)]
        for g, p in zip(grads, zero.params_in_partition[i]):
            if is_model_parallel_parameter(p) or zero.model_parallel_rank == 0:
                sq += sq_norm64(g)
    dist.all_reduce(sq, group=zero.dp_process_group)
    if zero.model_parallel_group is not None and dist.get_world_size(zero.model_parallel_group) > 1:
        dist.all_reduce(sq, group=zero.model_parallel_group)
    return sq


def install_global_norm(zero) -> None:
    """Replace the ZeRO-1/2 optimizer's `scaled_global_norm` (the norm it clips with, checks and reports) by the
    float64 `raw_grad_sq_norm`, non-finite as +inf (DeepSpeed's invalid-norm value). DeepSpeed 0.19.8 takes one
    model-parallel all-reduce per parameter group, and drops empty groups at initialisation, so ranks of one
    model-parallel group whose parts hold different rules (pipeline stages: the embedding's AdamW group on the
    first only, the LM head's on the last, neither on a middle one; peft's token rows) would pair up different
    collectives and hang or abort. Ours takes one all-reduce over data parallelism and one over model parallelism
    whatever the grouping, and its value does not depend on the layout."""
    def scaled_global_norm(norm_type=2):
        if norm_type != 2:
            raise NotImplementedError(f"the ZeRO gradient norm is the L2 norm; got norm_type={norm_type}")
        norm = raw_grad_sq_norm(zero).sqrt().float()
        return torch.where(torch.isfinite(norm), norm, torch.full_like(norm, math.inf))

    zero.scaled_global_norm = scaled_global_norm


def momentum_offsets(zero, group_idx: int) -> dict:
    """{param id(): element offset} of each whole matrix in DeepSpeed's flat Muon momentum of this rank's
    partition of group `group_idx` (the order `get_flat_partition` walks: `params_in_partition`)."""
    out, off = {}, 0
    for p in zero.params_in_partition[group_idx]:
        out[id(p)] = off
        off += p.numel()
    return out
