"""Tensor (and sequence) parallelism, applied to a built single-device K3 model from outside:
`apply_tensor_parallel(model, tp)` substitutes the parallel layers below for the model's linears, embedding and
loss, shards the KDA parameters that follow the heads, enters the TP region at the input of every attention and
MLP block, and installs the gradient hooks of replicated parameters whose gradient is a per-rank partial sum.
With tp = 1 it changes nothing.

Conventions inside a TP region (between its entry and a row-parallel exit):
- Entering makes the block input available to every TP rank: identity forward / all-reduce backward, or, under
  sequence parallelism, all-gather along the sequence / reduce-scatter backward. Its consumers must produce
  per-rank *partial* input gradients: column-parallel linears do.
- Small projections that must stay whole (a low-rank bottleneck, the MLA compressions) are column-parallel with
  gathered outputs; tensors computed from whole tensors are complete on every rank, and a column-parallel consumer
  of such a tensor copies it into the region first (`input_mode="copy"`), as does the broadcast of MLA's
  head-shared key part.
- Parameters split over TP carry `tp_dim` in their annotation (annotations); replicated parameters whose gradient
  is partial per rank (they see only this rank's heads or sequence shard) carry `partial_grad` and get their
  gradient summed over the TP group by a hook.
Every collective runs where the model computed before the redesign, so every layout gives the same numbers.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..annotations import annotate, copy_meta, meta
from ..model.decoder import DecoderLayer
from ..model.k3 import CausalLMOutput, K3ForCausalLM
from ..model.kda import KimiDeltaAttention
from ..model.mla import GatedMLA
from ..model.mlp import GatedMLP
from ..model.multimodal import MediaRows
from ..model.vision import media_shares, num_features
from . import mappings as M
from .mappings import Group

__all__ = ["TensorParallel", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "VocabParallelCrossEntropy", "vocab_parallel_cross_entropy", "apply_tensor_parallel", "shard_parameter",
           "mark_partial_grad"]


@dataclass(frozen=True)
class TensorParallel(Group):
    """The tensor-parallel group, and whether sequence parallelism shards the activations outside TP regions."""
    sequence_parallel: bool = False

    def enter(self, x):
        """Enter a TP region from this rank's activation (full, or a sequence shard under SP)."""
        if self.size == 1:
            return x
        return M.gather_seq(x, self.group) if self.sequence_parallel else M.copy_to_region(x, self.group)

    def exit(self, y):
        """Leave a TP region: sum the partial results (reduce-scatter along the sequence under SP)."""
        if self.size == 1:
            return y
        return M.reduce_scatter_seq(y, self.group) if self.sequence_parallel else M.reduce_from_region(y, self.group)

    def copy(self, x):
        return M.copy_to_region(x, self.group) if self.size > 1 else x

    def divide(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {self.size}")
        return n // self.size


def block_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of the block `t` (a view); on the meta device a new meta tensor of its shape (cloning a
    strided meta view goes through torch's Python reference kernels, whose first use imports sympy: ~0.7 s of every
    process's start-up)."""
    if t.is_meta:
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    return t.clone()


def shard_parameter(p: torch.Tensor, dim: int, tp: TensorParallel, what: str) -> nn.Parameter:
    """This rank's block of p along `dim`, as a new parameter annotated like p plus its split."""
    tp.divide(p.shape[dim], what)
    local = nn.Parameter(block_copy(p.detach().chunk(tp.size, dim)[tp.rank]), requires_grad=p.requires_grad)
    copy_meta(p, local)
    return annotate(local, tp_dim=dim, tp_size=tp.size, tp_rank=tp.rank)


def mark_partial_grad(p: nn.Parameter, tp: TensorParallel, per_step: bool = False) -> nn.Parameter:
    """p is replicated but its gradient on each TP rank is a partial sum: a hook sums it over the TP group, in each
    micro-batch's backward or, `per_step`, once per optimizer step (mappings.all_reduce_grad_once_per_step_hook)."""
    if not meta(p).partial_grad:
        annotate(p, partial_grad=True)
        p.register_hook(M.all_reduce_grad_once_per_step_hook(tp.group) if per_step else
                        M.all_reduce_grad_hook(tp.group))
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows: this rank holds W[rank-th block of rows].

    input_mode: "parallel" (the input is already in the TP region), "copy" (a tensor complete on every rank enters
    it: identity forward, all-reduce backward) or "enter" (this rank's activation enters it: also the sequence
    all-gather under SP). gather_output: all-gather the output columns, so that it is whole on every rank."""

    def __init__(self, linear: nn.Linear, tp: TensorParallel, gather_output: bool = False,
                 input_mode: str = "parallel"):
        super().__init__()
        self.tp, self.gather_output, self.input_mode = tp, gather_output, input_mode
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = shard_parameter(linear.weight, 0, tp, "output features")
        self.bias = shard_parameter(linear.bias, 0, tp, "output features") if linear.bias is not None else None

    def forward(self, x):
        if self.input_mode == "copy":
            x = self.tp.copy(x)
        elif self.input_mode == "enter":
            x = self.tp.enter(x)
        y = self.local_logits(x)
        return M.gather_last(y, self.tp.group) if self.gather_output else y

    def local_logits(self, x):
        """This rank's output columns of an input already in the TP region (the vocabulary-parallel LM head's logits
        of a token tile: parallel.tiling); an adapted layer (megatron_k3.peft) adds to it."""
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp.size}, gather_output="
                f"{self.gather_output}, input={self.input_mode}")


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_rank W_rank^T with W split by input columns; the sum is the region exit."""

    def __init__(self, linear: nn.Linear, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = shard_parameter(linear.weight, 1, tp, "input features")
        self.bias = linear.bias

    def forward(self, x_local):
        y = self.tp.exit(F.linear(x_local, self.weight))
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp.size}"


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over TP ranks; each rank looks up its own vocabulary range, the partial lookups are
    summed (reduce-scattered along the sequence under SP)."""

    def __init__(self, embedding: nn.Embedding, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.num_embeddings = embedding.num_embeddings
        self.weight = shard_parameter(embedding.weight, 0, tp, "model.vocab_size")
        self.start = tp.rank * self.weight.shape[0]

    def forward(self, ids):
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.exit(y)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, start, ignore_index):
        x = logits.float()
        local_max = x.max(-1).values
        gmax = local_max.clone()
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
        x = x - gmax.unsqueeze(-1)
        V = x.shape[-1]
        tgt = labels - start
        mine = (tgt >= 0) & (tgt < V)
        tgt_c = tgt.clamp(0, V - 1)
        picked = x.gather(-1, tgt_c.unsqueeze(-1)).squeeze(-1) * mine
        e = x.exp()
        sum_e = e.sum(-1)
        both = torch.stack([picked, sum_e])
        dist.all_reduce(both, group=group)
        picked, sum_e = both[0], both[1]
        loss = torch.log(sum_e) - picked
        valid = labels != ignore_index
        loss = loss * valid
        ctx.save_for_backward(e, sum_e, tgt_c, mine, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        e, sum_e, tgt_c, mine, valid = ctx.saved_tensors
        grad = e / sum_e.unsqueeze(-1)
        grad.scatter_add_(-1, tgt_c.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad = grad * (g * valid).unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_local, labels, tp: Group, vocab_start: int, ignore_index: int = -100):
    """Mean cross-entropy over non-ignored tokens from vocabulary-sharded logits [N, V/tp]; the full-vocab softmax is
    formed with three reductions (max, target logit, sum of exponentials), never gathered."""
    if tp.size == 1:
        return F.cross_entropy(logits_local.float(), labels, ignore_index=ignore_index)
    per_token = _VocabParallelCE.apply(logits_local, labels, tp.group, vocab_start, ignore_index)
    return per_token.sum() / (labels != ignore_index).sum().clamp_min(1)


class VocabParallelCrossEntropy(nn.Module):
    """The model's loss on vocabulary-sharded logits: this rank holds vocabulary columns [rank * V/tp, ...)."""

    ignore_index = -100

    def __init__(self, tp: TensorParallel):
        super().__init__()
        self.tp = tp

    def forward(self, logits_NV, labels_N):
        return vocab_parallel_cross_entropy(logits_NV, labels_N, self.tp, self.tp.rank * logits_NV.shape[-1],
                                            self.ignore_index)


# ---------------------------------------------------------------------------------------------- the plan

def call_arguments(model, args, kwargs) -> inspect.BoundArguments:
    """The model's forward arguments of one call (K3ForCausalLM's, or a subclass's), by name (defaults applied)."""
    bound = inspect.signature(type(model).forward).bind(model, *args, **kwargs)
    bound.apply_defaults()
    return bound


def _enter_region(tp: TensorParallel):
    def hook(module, args):
        return (tp.enter(args[0]),) + tuple(args[1:])
    return hook


def _copy_first_argument(tp: TensorParallel):
    def hook(module, args):
        return (tp.copy(args[0]),) + tuple(args[1:])
    return hook


def _column(module, name, tp, **kw):
    setattr(module, name, ColumnParallelLinear(getattr(module, name), tp, **kw))


def _row(module, name, tp):
    setattr(module, name, RowParallelLinear(getattr(module, name), tp))


def _shard(module, name, dim, tp, what):
    setattr(module, name, shard_parameter(getattr(module, name), dim, tp, what))


def _kda(m: KimiDeltaAttention, tp: TensorParallel):
    """Heads split: q/k/v/gate/decay projections by output rows, their conv filters and per-head gate parameters
    alike, o_proj by input columns; the low-rank decay and gate bottlenecks stay whole (gathered)."""
    m.register_forward_pre_hook(_enter_region(tp))
    for name in ("q_proj", "k_proj", "v_proj"):
        _column(m, name, tp)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d", "A_log", "dt_bias"):
        _shard(m, name, 0, tp, f"{name} rows")
    _column(m, "f_a_proj", tp, gather_output=True)
    _column(m, "f_b_proj", tp, input_mode="copy")
    _column(m, "b_proj", tp)
    if m.lowrank_gate:
        _column(m, "g_a_proj", tp, gather_output=True)
        _column(m, "g_b_proj", tp, input_mode="copy")
    else:
        _column(m, "g_proj", tp)
    mark_partial_grad(m.o_norm, tp)  # each rank applies it to its own heads only
    _row(m, "o_proj", tp)


def _mla(m: GatedMLA, tp: TensorParallel):
    """Heads split; the q and kv compressions stay whole on every rank (gathered), and what is computed from them
    (the query/key-value expansions' inputs, the head-shared key part) enters the region by a copy."""
    m.register_forward_pre_hook(_enter_region(tp))
    if m.q_lora_rank:
        _column(m, "q_a_proj", tp, gather_output=True)
        _column(m, "q_b_proj", tp, input_mode="copy")
    else:
        _column(m, "q_proj", tp)
    _column(m, "kv_a_proj_with_mqa", tp, gather_output=True)
    _column(m, "kv_b_proj", tp, input_mode="copy")
    m.k_rope_broadcast.register_forward_pre_hook(_copy_first_argument(tp))
    if m.gated:
        _column(m, "g_proj", tp)
    _row(m, "o_proj", tp)


def _mlp(m: GatedMLP, tp: TensorParallel):
    """Megatron-style: gate/up by output rows, down by input columns."""
    m.register_forward_pre_hook(_enter_region(tp))
    _column(m, "gate_proj", tp)
    _column(m, "up_proj", tp)
    _row(m, "down_proj", tp)


def _sequence_sharded(modules, tp: TensorParallel):
    """Under SP the norms and depth mixes outside TP regions see this rank's sequence shard only."""
    if tp.sequence_parallel:
        for mod in modules:
            if mod is not None:
                for p in mod.parameters():
                    mark_partial_grad(p, tp)


def apply_tensor_parallel(module: nn.Module, tp: TensorParallel) -> nn.Module:
    """Shard `module` (unsharded, single device: a K3ForCausalLM, or any part of one) over the TP group in place;
    returns it. The routed MoE branch is expert parallelism's (parallel.experts), the shared experts are split like
    any MLP here."""
    if tp.size == 1:
        return module
    for mod in list(module.modules()):
        if isinstance(mod, KimiDeltaAttention):
            _kda(mod, tp)
        elif isinstance(mod, GatedMLA):
            _mla(mod, tp)
        elif isinstance(mod, GatedMLP):
            _mlp(mod, tp)
        elif isinstance(mod, DecoderLayer):
            _sequence_sharded([mod.input_layernorm, mod.post_attention_layernorm,
                               getattr(mod, "self_attention_res", None), getattr(mod, "mlp_res", None)], tp)
    if isinstance(module, K3ForCausalLM):
        _model_ends(module, tp)
    return module


class _MediaShare:
    """The media of a batch split over the TP ranks: before the tower runs, this rank keeps its share (contiguous
    whole media of about equal patch counts, model.vision.media_shares; a rank may get none); after the projector,
    every rank's features are gathered, in order."""

    def __init__(self, tp: TensorParallel):
        self.tp, self.sizes = tp, None

    def take(self, tower, args):
        pixel_values, grids = args
        shares = media_shares(grids, self.tp.size)
        first, end = shares[self.tp.rank]
        rows, counts = [t * h * w for t, h, w in grids], num_features(grids, tower.vcfg)
        self.sizes = [sum(counts[a:b]) for a, b in shares]
        return pixel_values[sum(rows[:first]):sum(rows[:end])], grids[first:end]

    def gather(self, projector, args, out):
        sizes, self.sizes = self.sizes, None
        return out if sizes is None else M.gather_var_rows(out, sizes, self.tp.group)


def _sequence_share_of_media(tp: TensorParallel):
    """Under SP the embeddings hold this rank's sequence share: so do the media rows put into them (the backward
    gathers their gradient)."""
    def hook(core, args, kwargs):
        media = kwargs.get("media")
        if isinstance(media, MediaRows):
            kwargs["media"] = MediaRows(M.split_seq(media.rows, tp.group), M.split_seq(media.mask, tp.group))
        return args, kwargs
    return hook


def _vision(model, tp: TensorParallel) -> None:
    """The vision tower is replicated over TP, its work is not: each rank encodes a share of the media and the
    features are gathered (_MediaShare, hooks around the tower and the projector); each rank's gradient of the
    tower's parameters, computed from its share, is summed over the group by a hook once per optimizer step (the
    micro-batches' partial gradients summed locally first: one all-reduce of the tower's size per step, not one per
    micro-batch). Under SP each rank then puts in the features of its own sequence share.

    Why not shard it like the text layers: ~0.45B parameters at K3 size against 2.8T, and splitting 12 heads and a
    1024 width would add two collectives per block. Why not replicate the work: every rank would run the whole
    tower. The split is by whole media, so it pays when a micro-batch holds at least tp media; with one image one
    rank encodes it and the others wait (docs/vision.md, docs/planning.md give the planner's figures)."""
    share = _MediaShare(tp)
    model.vision_tower.register_forward_pre_hook(share.take)
    model.mm_projector.register_forward_hook(share.gather)
    for p in model.vision_parameters():
        if p.requires_grad:  # model.freeze_vision: nothing to sum
            mark_partial_grad(p, tp, per_step=True)
    if tp.sequence_parallel:
        model.model.register_forward_pre_hook(_sequence_share_of_media(tp), with_kwargs=True)


def _model_ends(model: K3ForCausalLM, tp: TensorParallel) -> None:
    """The vocabulary-parallel embedding, LM head and loss, the final norms under SP, the full logits on request."""
    core = model.model
    _sequence_sharded([core.norm, getattr(core, "output_attn_res", None)], tp)  # None on a cut pipeline stage
    tied = model.lm_head is not None and core.embed_tokens is not None and \
        model.lm_head.weight is core.embed_tokens.weight
    if core.embed_tokens is not None:
        core.embed_tokens = VocabParallelEmbedding(core.embed_tokens, tp)
    if model.lm_head is not None:
        model.lm_head = ColumnParallelLinear(model.lm_head, tp, input_mode="enter")  # vocabulary-parallel logits
        if tied:
            model.lm_head.weight = core.embed_tokens.weight
    model.loss_fn = VocabParallelCrossEntropy(tp)
    if getattr(model, "vision_tower", None) is not None:
        _vision(model, tp)

    def no_decode_under_sp(module, args, kwargs):
        if call_arguments(module, args, kwargs).arguments["cache"] is not None:
            raise ValueError("sequence parallelism is for training; decode with parallel.sequence_parallel=false")

    def full_logits(module, args, kwargs, out):
        """Vocabulary-sharded logits are gathered only when asked for (return_logits, default: no labels)."""
        if not isinstance(out, CausalLMOutput):  # a pipeline stage before the last
            return out
        call = call_arguments(module, args, kwargs).arguments
        wanted = call["return_logits"] if call["return_logits"] is not None else call["labels"] is None
        out.logits = M.gather_last(out.logits, tp.group) if wanted else None
        return out

    if tp.sequence_parallel:
        model.register_forward_pre_hook(no_decode_under_sp, with_kwargs=True)
    model.register_forward_hook(full_logits, with_kwargs=True)
