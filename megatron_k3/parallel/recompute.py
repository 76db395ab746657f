"""Activation recomputation (`train.recompute`), applied to a built model from outside, as parallelism is: the
model's code does not change, its regions are wrapped in torch.utils.checkpoint (non-reentrant, RNG state kept) so
that the backward runs them again instead of keeping what they made.

Policies, with the planner's meanings (megatron_k3.planning.activations):

- `none`: everything autograd keeps is kept.
- `selective`: the regions named by `train.recompute_modules` (all of MODULES when empty) keep only their inputs;
  the terms the planner marks `cheap` for those modules are rebuilt in the backward:
  - `attn_res`: each Block Attention Residual depth mix (its stacked fp32 sources and softmax; DepthMix.mix);
  - `layernorm`: the RMSNorms before the mixer, before the FFN, on the MoE latent and before the LM head, and the
    vision tower's;
  - `core_attn`: KDA between its input projections and o_proj (short convolutions, L2 norms, gates, the chunked
    delta rule, the gated output norm), MLA's attention (the probabilities), the vision tower's attention;
  - `mlp_act`: the gated activation of the dense FFN and the shared experts;
  - `moe_act`: the routed experts' gated activation (the gate/up GEMM's output is kept, its fp32 intermediates
    are made again; ops.grouped_gemm.GateUpGLU's `rebuild`).
- `full`: a decoder layer keeps only its input (the state between layers) and runs again, whole, in its backward;
  `train.recompute_num_layers` > 0 limits it to that many layers per pipeline stage, counted from the stage's first
  (Megatron's `--recompute-method block`); the vision tower's blocks likewise. With `train.offload_buffer_gb` the
  recomputed layers' inputs go to host memory until their backward (parallel.offload; `model.host_offload`).

Recomputation changes no number: the regions run the same operations on the same inputs (bit-identical losses and
gradients; tests/test_recompute.py). What a forward records besides its output (Quantile Balancing's observation,
expert-load counts, the balanced dispatch's statistics, AttnRes depth weights, QK-Clip's max logit) is recorded by
the first pass only (model.layers.recomputing), and checkpoint restores the RNG it used (the CPU's and, on CUDA, the
current device's: checkpointed_call names the device to torch's checkpoint, which finds devices among tensor
arguments only), so those happen once per micro-batch whatever the policy. Collectives inside a region
(sequence-parallel gathers, the MoE all-to-alls, context parallelism's exchanges) run again in the backward on every
rank of their group alike.

Under `train.compile` the whole-layer wrapper goes around the compiled layer (the recomputation calls the same
compiled code). With train.compile_split=regions (the default) each selective region is compiled as its own graph
(training.compile splits a layer at `regions`) and the checkpoint wraps it between the layer's graphs, so the backward
calls the region's compiled forward again: bit for bit under inductor too. With compile_split=layer the regions are
traced inside the layer as torch's checkpoint operator (inductor fuses the rebuilt operations into the backward's
kernels: rounding).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ..config.schema import RECOMPUTE_MODULES as MODULES
from ..config.schema import RECOMPUTE_POLICIES as POLICIES
from ..config.schema import recomputed_kinds
from ..model.decoder import DecoderLayer, DepthMix, ResidualState
from ..model.experts import GroupedExperts
from ..model.kda import KimiDeltaAttention
from ..model.mla import GatedMLA
from ..model.mlp import GatedMLP
from ..model.norm import RMSNorm
from ..model.vision import VisionBlock
from .offload import HostOffload

__all__ = ["POLICIES", "MODULES", "Policy", "apply", "regions", "checkpointed_call", "FORWARD_CONTEXTS"]

# What a precision enters around the forward besides torch.autocast (which torch's checkpoint restores for the
# recomputation itself): TransformerEngine's FP8 autocast, pushed by precision.forward_context while its forward
# runs (factories of context managers). The backward, where the recomputation runs, is outside them, so a checkpoint
# taken inside one enters it again for the recomputation, as TE's own checkpoint does: te.Linear then recomputes in
# FP8 with the forward's recipe, not in bf16 (other numbers than the forward's, and than train.recompute=none).
FORWARD_CONTEXTS: list = []


@contextlib.contextmanager
def _entered(makers):
    with contextlib.ExitStack() as stack:
        for make in makers:
            stack.enter_context(make())
        yield


def _contexts(makers):
    return contextlib.nullcontext(), _entered(makers)


_ANCHORS: dict = {}  # CUDA device index -> an empty tensor on it (_device_anchor)


def _device_anchor():
    """An empty tensor on the current CUDA device, where CUDA is in use (None elsewhere, and inside a compiled graph,
    whose checkpoint keeps the RNG its own way). torch's checkpoint stashes and restores the RNG state of the devices
    it finds among the tensor arguments only: a region called with none (the offloaded layer) or with a
    ResidualState (a whole layer; pytree does not open it) would recompute with the CUDA generator where the forward
    left it. Handed to the checkpoint beside the arguments, the anchor names the device."""
    if torch.compiler.is_compiling() or not torch.cuda.is_initialized():
        return None
    index = torch.cuda.current_device()
    if index not in _ANCHORS:
        _ANCHORS[index] = torch.empty(0, device=torch.device("cuda", index))
    return _ANCHORS[index]


def _without_anchor(fn, _anchor, *args, **kwargs):
    return fn(*args, **kwargs)


def checkpointed_call(fn, *args, **kwargs):
    """fn(*args, **kwargs) under torch's non-reentrant checkpoint, the RNG state kept (the CPU's and the current
    CUDA device's), the recomputation in the FORWARD_CONTEXTS this forward runs in."""
    anchor = _device_anchor()
    if anchor is not None:
        fn, args = functools.partial(_without_anchor, fn), (anchor, *args)
    if FORWARD_CONTEXTS:
        return _checkpoint_in_contexts(fn, *args, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


# inside a compiled graph (train.compile_split=layer's regions, token tiles in a compiled layer) dynamo takes no
# context_fn of this kind: such a checkpoint runs eagerly, a graph break
@torch.compiler.disable
def _checkpoint_in_contexts(fn, *args, **kwargs):
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=functools.partial(_contexts, tuple(FORWARD_CONTEXTS)), **kwargs)

# the RMSNorms of `layernorm`, by their attribute names (DepthMix's key norm is a weight its mix reads, not called)
_NORMS = ("input_layernorm", "post_attention_layernorm", "latent_norm", "norm", "norm0", "norm1", "final_layernorm",
          "post_norm")


@dataclass(frozen=True)
class Policy:
    """A resolved recomputation policy (`auto` is resolved by the planner before a model is built)."""
    name: str = "none"  # none, selective, full
    modules: tuple = ()  # selective: the module kinds recomputed (empty: all of MODULES)
    num_layers: int = 0  # full: decoder layers per stage recomputed, from the stage's first (0: all)
    offload_bytes: int = 0  # full: host memory for the recomputed layers' inputs (parallel.offload; 0: off)

    def __post_init__(self):
        if self.name not in POLICIES[:3]:
            raise ValueError(f"recompute policy must be one of none, selective, full (auto is resolved first), "
                             f"got {self.name!r}")
        bad = [m for m in self.modules if m not in MODULES]
        if bad:
            raise ValueError(f"unknown recompute module(s) {bad}: valid {', '.join(MODULES)}")
        for what, v, zero in (("num_layers", self.num_layers, "all"), ("offload_bytes", self.offload_bytes, "off")):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:  # -1 would slice to "all but the last"
                raise ValueError(f"recompute {what} must be an integer >= 0 (0: {zero}), got {v!r}")
        if self.offload_bytes and self.name != "full":
            raise ValueError("activation offload moves what full recomputation keeps (the layer inputs): it needs "
                             f"the full policy, not {self.name}")

    @property
    def selected(self) -> frozenset:
        """The module kinds recomputed under selective (empty for none and full)."""
        return recomputed_kinds(self.name, self.modules)


def _checkpointed(fn):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation, generation: nothing is kept, nothing to recompute
            return fn(*args, **kwargs)
        return checkpointed_call(fn, *args, **kwargs)
    if getattr(fn, "compiled", None) is not None:
        # compiled code (training.compile): a region compiled as its own graph (train.compile_split=regions), whose
        # checkpoint then runs between the layer's graphs and calls the region's compiled code in the forward and
        # again in the backward, or a compiled layer under full (called from eager code anyway)
        run = torch.compiler.disable(run)
    run.recomputes = fn
    return run


def _wrap(obj, attr: str) -> int:
    """obj.attr becomes its checkpointed self (once); 1 if it was wrapped now."""
    fn = getattr(obj, attr)
    if getattr(fn, "recomputes", None) is not None:
        return 0
    setattr(obj, attr, _checkpointed(fn))
    return 1


def regions(model: torch.nn.Module, kinds=MODULES):
    """(kind, owner, attribute) of every region of `kinds` in `model` that selective recomputation wraps: a method
    whose inputs are kept and whose work is rebuilt in the backward. `moe_act` is not among them: the routed
    experts' activation is rebuilt inside their fused operator (GroupedExperts.recompute_act)."""
    for parent in model.modules():
        if "attn_res" in kinds and isinstance(parent, DepthMix):
            yield "attn_res", parent, "mix"
        if "core_attn" in kinds:
            if isinstance(parent, (KimiDeltaAttention, VisionBlock)):
                yield "core_attn", parent, "core"
            elif isinstance(parent, GatedMLA):
                yield "core_attn", parent.kernels, "attend"
        if "mlp_act" in kinds and isinstance(parent, GatedMLP):
            yield "mlp_act", parent, "activation"
        if "layernorm" in kinds and not isinstance(parent, DepthMix):
            for name, child in parent.named_children():
                if isinstance(child, RMSNorm) and name in _NORMS:
                    yield "layernorm", child, "forward"


def _selective(model, kinds: frozenset) -> dict:
    done = dict.fromkeys(kinds, 0)
    for kind, owner, attr in regions(model, kinds):
        done[kind] += _wrap(owner, attr)
    if "moe_act" in kinds:
        for m in model.modules():
            if isinstance(m, GroupedExperts):
                m.recompute_act = True
                done["moe_act"] += 1
    return done


def _offloaded(fn, off):
    """A decoder layer's forward under full recomputation with its inputs offloaded (parallel.offload): the
    checkpointed function reads the layer's inputs from a box, the device tensors during the forward and their host
    copies (read back through `off`) when the backward recomputes it; the checkpoint itself holds none of them."""
    def run(st, cu_seqlens=None, cache_state=None, seq_idx=None):
        if not torch.is_grad_enabled():
            return fn(st, cu_seqlens, cache_state, seq_idx)
        attn_res = st.hidden is None
        box = {"live": list(st.blocks) + [st.partial] if attn_res else [st.hidden], "packed": None}
        grads = [t.requires_grad for t in box["live"]]

        def inner():
            ts = box["live"] if box["packed"] is None else [
                off.unpack(p).detach().requires_grad_(g) for p, g in zip(box["packed"], grads)]
            s = ResidualState(blocks=list(ts[:-1]), partial=ts[-1]) if attn_res else ResidualState(hidden=ts[0])
            return fn(s, cu_seqlens, cache_state, seq_idx)
        out = checkpointed_call(inner)
        box["packed"], box["live"] = off.pack_layer(box["live"]), None
        return out
    run.recomputes = fn
    return run


def _full(model, num_layers: int, offload_bytes: int = 0) -> dict:
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    layers = layers[:num_layers] if num_layers else layers
    blocks = [m for m in model.modules() if isinstance(m, VisionBlock)]
    done = {"layers": 0, "vision_blocks": sum(_wrap(m, "forward") for m in blocks)}
    if offload_bytes:
        model.host_offload = HostOffload(offload_bytes)
        for m in layers:
            if getattr(m.forward, "recomputes", None) is None:
                m.forward = _offloaded(m.forward, model.host_offload)
                done["layers"] += 1
        done["offload_gb"] = offload_bytes / 1e9
        return done
    done["layers"] = sum(_wrap(m, "forward") for m in layers)
    return done


def apply(model: torch.nn.Module, policy: Policy) -> dict:
    """Wrap this rank's part of the model for `policy` in place (after parallelism, precision and compilation are
    applied, before the first forward); returns how many regions of each kind were wrapped."""
    if policy.name == "full":
        return _full(model, policy.num_layers, policy.offload_bytes)
    if policy.name == "selective":
        return _selective(model, policy.selected)
    return {}
