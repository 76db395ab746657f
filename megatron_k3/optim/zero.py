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

What does not fit, and is replaced: DeepSpeed's update (EMA momentum, a sqrt(max(1, A/B)) scale, heads
only along rows and not at all in its padded-partition path, torch.compile'd, so a C++ build on CPU) is
called without the parameter. `attach(engine)` therefore wraps the ZeRO optimizer's `get_flat_partition`:
for a Muon group it maps each gradient DeepSpeed will pass back to its parameter and, for the duration of
the call, points `original_muon.muon_update` at `Muon.muon_update`, the code the single-process optimizer
runs (head blocks on either axis, experts, the TP gather, our scale and momentum). QK-Clip runs after
DeepSpeed has gathered the updated weights and writes the rescaled rows into the fp32 master partitions.

DeepSpeed clips the norm of whatever holds the gradient's place, here the orthogonalised update, so
`gradient_clipping` must be 0 (Newton-Schulz normalises the momentum anyway); its config also needs
`zero_allow_untested_optimizer: true`. CPU offload takes a different DeepSpeed path and is refused.
"""

from __future__ import annotations

import contextlib

import torch
import deepspeed.runtime.zero.muon.original_muon as ds_muon
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

from .muon import Muon


class ZeroMuon(Muon, MuonWithAuxAdam):
    """Muon as DeepSpeed's ZeRO recognises it (a MuonWithAuxAdam, "muon" in the class name). Without ZeRO
    (stage 0) it steps exactly like Muon; under ZeRO-1/2 it needs `attach(engine)`."""

    def __init__(self, param_groups: list, tp=None, qk_clip=None):
        Muon.__init__(self, param_groups, tp, qk_clip)  # not MuonWithAuxAdam.__init__: no inner Adam
        self.aux_optimizer = None
        self.attached = False

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

    def _after_step(self):
        if not self.attached:  # under ZeRO, QK-Clip waits until DeepSpeed has gathered the new weights
            Muon._after_step(self)


@contextlib.contextmanager
def _muon_update_is(fn):
    saved = ds_muon.muon_update
    ds_muon.muon_update = fn  # stage_1_and_2 imports it by name from this module on every call
    try:
        yield
    finally:
        ds_muon.muon_update = saved


def attach(engine) -> ZeroMuon:
    """Route DeepSpeed ZeRO-1/2's Muon update through ours (see the module docstring). `engine` is the
    DeepSpeedEngine from deepspeed.initialize (or its ZeRO optimizer). Returns the ZeroMuon."""
    zero = getattr(engine, "optimizer", engine)
    opt = getattr(zero, "optimizer", None)
    if not isinstance(opt, ZeroMuon):
        raise TypeError(f"attach() needs the ZeroMuon from build_optimizer(model, cfg, zero=True) inside a ZeRO "
                        f"optimizer; got {type(zero).__name__} around {type(opt).__name__}")
    if not hasattr(zero, "get_flat_partition") or not hasattr(zero, "all_grad_tensors"):
        raise TypeError(f"attach() supports ZeRO stages 1 and 2; got {type(zero).__name__}")
    if getattr(zero, "cpu_offload", False):
        raise NotImplementedError("Muon with ZeRO CPU offload: DeepSpeed's offload path runs its own Muon update")
    clip = engine.gradient_clipping() if hasattr(engine, "gradient_clipping") else getattr(zero, "clip_grad", 0.0)
    if clip:
        raise ValueError(f"deepspeed gradient_clipping={clip}: with Muon under ZeRO DeepSpeed would clip the norm of "
                         "the orthogonalised updates, not of the gradients; set gradient_clipping to 0")
    if opt.attached:
        return opt
    original = zero.get_flat_partition

    def get_flat_partition(tensor_list, first_offset, partition_size, dtype, device, param_group_idx,
                           return_tensor_list=False):
        group = opt.param_groups[param_group_idx]
        args = (tensor_list, first_offset, partition_size, dtype, device, param_group_idx, return_tensor_list)
        if not group.get("use_muon"):
            return original(*args)
        grads = zero.all_grad_tensors[param_group_idx]
        owner = {id(g): p for p, g in zip(tensor_list, grads)}  # the gradients DeepSpeed hands muon_update

        def update(grad, momentum, *_, **__):
            return opt.muon_update(owner[id(grad)], grad, momentum, group)

        with _muon_update_is(update):
            return original(*args)

    zero.get_flat_partition = get_flat_partition
    if opt.qk_clip is not None:
        original_step = zero.step

        def step(*args, **kwargs):
            out = original_step(*args, **kwargs)
            for p in opt.qk_clip.apply():
                if hasattr(p, "set_full_hp_param"):  # the fp32 master partition DeepSpeed steps from
                    p.set_full_hp_param(p.data)
            return out

        zero.step = step
    opt.attached = True
    return opt
