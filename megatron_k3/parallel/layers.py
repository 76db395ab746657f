"""Tensor-parallel building blocks: column- and row-parallel linears, a vocab-parallel embedding and
cross-entropy, and the tensor-parallel context a model module captures at construction.

With a tensor-parallel size of 1 every block is plain nn.Linear / nn.Embedding / cross-entropy, with the
same parameter names and shapes, so the model reads as single-device code.

Conventions inside a TP region (between `enter` and a row-parallel exit):
- `enter(x)` makes the layer input available to every TP rank: identity forward / all-reduce backward,
  or, under sequence parallelism, all-gather along the sequence / reduce-scatter backward. Its consumers
  must produce per-rank *partial* input gradients: column-parallel linears do.
- Small projections that must stay whole (a low-rank bottleneck, the MLA compressions) are column-parallel
  with `gather_output=True`; tensors computed from whole tensors are complete on every rank, and re-enter
  a region with `copy_to_region` before a column-parallel consumer.
- Sharded parameters carry `tp_split_dim` (0 or 1); replicated parameters whose gradient is partial per rank
  (they see only this rank's heads or sequence shard) carry `tp_partial_grad = True` and get their gradient
  summed over the TP group by a hook.
- The optimizer's grouping reads more annotations (megatron_k3.optim.muon): `muon_blocks`,
  `muon_block_axis` and `muon_block_kind` (the full, unsharded matrix is that many equal blocks along that
  axis: attention heads, or fused shared experts), `muon_batched` (the leading axis indexes independent
  matrices: routed experts) and `muon_exclude` (a matrix that stays on AdamW, with the reason).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import mappings as M


@dataclass(frozen=True)
class TPContext:
    group: object = None
    size: int = 1
    rank: int = 0
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


_SEQUENCE_PARALLEL = False
_OVERRIDE: TPContext | None = None


class use_tp:
    """Context manager: modules constructed inside use `ctx` instead of parallel.state's group."""

    def __init__(self, ctx: TPContext):
        self.ctx, self.prev = ctx, None

    def __enter__(self):
        global _OVERRIDE
        self.prev, _OVERRIDE = _OVERRIDE, self.ctx
        return self.ctx

    def __exit__(self, *exc):
        global _OVERRIDE
        _OVERRIDE = self.prev
        return False


def set_sequence_parallel(flag: bool):
    global _SEQUENCE_PARALLEL
    _SEQUENCE_PARALLEL = bool(flag)


def current_tp() -> TPContext:
    """The tensor-parallel context of this process, from parallel.state (size 1 when not initialised)."""
    if _OVERRIDE is not None:
        return _OVERRIDE
    try:
        from . import state
    except ImportError:  # pragma: no cover - state is part of the package
        return TPContext()
    if not (dist.is_initialized() and state.model_parallel_is_initialized()):
        return TPContext()
    size = state.get_tensor_model_parallel_world_size()
    if size == 1:
        return TPContext()
    return TPContext(state.get_tensor_model_parallel_group(), size, state.get_tensor_model_parallel_rank(),
                     _SEQUENCE_PARALLEL)


@dataclass(frozen=True)
class EPContext:
    """The expert-parallel group a MoE layer dispatches over: this rank holds experts
    [rank * E / size, (rank + 1) * E / size) of E."""
    group: object = None
    size: int = 1
    rank: int = 0


def current_ep() -> EPContext:
    if not dist.is_initialized():
        return EPContext()
    from . import state

    if not state.model_parallel_is_initialized() or state.get_expert_model_parallel_world_size() == 1:
        return EPContext()
    return EPContext(state.get_expert_model_parallel_group(), state.get_expert_model_parallel_world_size(),
                     state.get_expert_model_parallel_rank())


def mark_expert_sharded(p: nn.Parameter, ep: EPContext) -> nn.Parameter:
    """A routed-expert weight [E_local, ...]: this rank's block of experts along dim 0. Excluded from the dense
    data-parallel reduction (it is reduced over the expert-data-parallel group instead)."""
    p.ep_size, p.ep_rank = ep.size, ep.rank
    p.expert_parallel = ep.size > 1
    return p


def mark_sharded(p: nn.Parameter, dim: int) -> nn.Parameter:
    p.tp_split_dim = dim
    p.tensor_model_parallel = True  # the names DeepSpeed and Megatron look for (grad-norm bookkeeping)
    p.model_parallel = True
    p.partition_dim = dim
    return p


def mark_partial_grad(p: nn.Parameter) -> nn.Parameter:
    p.tp_partial_grad = True
    return p


def mark_head_blocks(p: nn.Parameter, heads: int, axis: int) -> nn.Parameter:
    """The full p is `heads` attention heads (all ranks' heads) in equal blocks along `axis`: 0 for a
    projection into the heads ([H*K, in]), 1 for the projection out of them ([out, H*K])."""
    p.muon_blocks, p.muon_block_axis, p.muon_block_kind = heads, axis, "heads"
    return p


def mark_expert_blocks(p: nn.Parameter, experts: int, axis: int) -> nn.Parameter:
    """The full p is `experts` fused experts' matrices in equal blocks along `axis` (shared experts)."""
    p.muon_blocks, p.muon_block_axis, p.muon_block_kind = experts, axis, "experts"
    return p


def mark_batched_matrices(p: nn.Parameter) -> nn.Parameter:
    """p's leading axis indexes independent matrices (routed experts [E, out, in])."""
    p.muon_batched = True
    return p


def mark_adamw_only(p: nn.Parameter, reason: str) -> nn.Parameter:
    """A matrix that is not a hidden linear map (embedding, LM head, AttnRes pseudo-query): AdamW, not Muon."""
    p.muon_exclude = reason
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows: this rank holds W[rank-th block of rows]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, gather_output: bool = False,
                 tp: TPContext | None = None):
        super().__init__()
        self.tp = tp or current_tp()
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        local = self.tp.divide(out_features, "output features")
        self.weight = mark_sharded(nn.Parameter(torch.empty(local, in_features)), 0)
        self.bias = mark_sharded(nn.Parameter(torch.zeros(local)), 0) if bias else None

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return M.gather_last(y, self.tp.group) if (self.gather_output and self.tp.size > 1) else y

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp.size}, gather_output={self.gather_output}"


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_rank W_rank^T with W split by input columns; the sum is the region exit."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPContext | None = None):
        super().__init__()
        self.tp = tp or current_tp()
        self.in_features, self.out_features = in_features, out_features
        local = self.tp.divide(in_features, "input features")
        self.weight = mark_sharded(nn.Parameter(torch.empty(out_features, local)), 1)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x_local):
        y = self.tp.exit(F.linear(x_local, self.weight))
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp.size}"


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over TP ranks; each rank looks up its own vocabulary range, the partial
    lookups are summed (reduce-scattered along the sequence under SP)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPContext | None = None):
        super().__init__()
        self.tp = tp or current_tp()
        self.num_embeddings = num_embeddings
        local = self.tp.divide(num_embeddings, "model.vocab_size")
        self.start = self.tp.rank * local
        self.weight = mark_sharded(nn.Parameter(torch.empty(local, embedding_dim)), 0)

    def forward(self, ids):
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
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


def vocab_parallel_cross_entropy(logits_local, labels, tp: TPContext, vocab_start: int, ignore_index: int = -100):
    """Mean cross-entropy over non-ignored tokens from vocabulary-sharded logits [N, V/tp]; the full-vocab
    softmax is formed with three reductions (max, target logit, sum of exponentials), never gathered."""
    if tp.size == 1:
        return F.cross_entropy(logits_local.float(), labels, ignore_index=ignore_index)
    per_token = _VocabParallelCE.apply(logits_local, labels, tp.group, vocab_start, ignore_index)
    return per_token.sum() / (labels != ignore_index).sum().clamp_min(1)


def shard_tensor(full: torch.Tensor, p: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """This rank's slice of a full (unsharded) tensor for parameter p."""
    ep = getattr(p, "ep_size", 1)
    if ep > 1:
        full = full.chunk(ep, dim=0)[p.ep_rank]
    dim = getattr(p, "tp_split_dim", None)
    if dim is None or tp.size == 1:
        return full
    return full.chunk(tp.size, dim=dim)[tp.rank]


def full_shape(p: torch.Tensor, tp: TPContext) -> tuple:
    dim = getattr(p, "tp_split_dim", None)
    shape = list(p.shape)
    if dim is not None:
        shape[dim] *= tp.size
    shape[0] *= getattr(p, "ep_size", 1)
    return tuple(shape)
