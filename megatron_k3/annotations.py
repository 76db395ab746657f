"""What a parameter is beyond its values: one typed annotation (`ParamMeta`) on every parameter that needs one. It
lives below the model and the parallel plans because both write it, and the optimizer, the checkpoints and the
planner read it.

The model sets the maths (which independent matrices a tensor holds, and which tensors are not hidden linear
maps); `megatron_k3.parallel` adds how this rank holds it (its tensor-parallel split, its block of routed
experts, whether its gradient is a per-rank partial sum). The optimizer, the checkpoints and the planner read it;
`copy_meta` carries it to a copy of the parameter (fp32 master weights, a TransformerEngine linear).

DeepSpeed reads its own attribute names (`tensor_model_parallel`, `model_parallel`, `partition_dim`) to count
tensor-parallel shards in gradient norms; `annotate` derives them from the annotation, so they are never set by
hand anywhere else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["ParamMeta", "annotate", "meta", "copy_meta", "full_shape", "shard_offsets", "ATTR"]

ATTR = "k3_meta"


@dataclass(frozen=True)
class ParamMeta:
    # ---- the maths (megatron_k3.model)
    adamw_reason: str | None = None  # a matrix that is no hidden linear map (embedding, lm_head, AttnRes query)
    blocks: int = 1  # the full tensor is `blocks` independent matrices in equal blocks along `block_axis`:
    block_axis: int = 0  # attention heads ([H*K, in] on axis 0, [out, H*K] on axis 1) or fused shared experts
    block_kind: str | None = None  # "heads" or "experts"
    batched: bool = False  # the leading axis indexes independent matrices (routed experts [E, out, in])
    # ---- the layout on this rank (megatron_k3.parallel)
    tp_dim: int | None = None  # split over the tensor-parallel group along this dimension
    tp_size: int = 1
    tp_rank: int = 0
    partial_grad: bool = False  # replicated, but each TP rank's gradient is a partial sum: summed by a hook
    ep_size: int = 1  # routed experts: this rank holds block ep_rank of ep_size along dim 0
    ep_rank: int = 0

    @property
    def expert_parallel(self) -> bool:
        return self.ep_size > 1


_DEFAULT = ParamMeta()


def meta(p: torch.Tensor) -> ParamMeta:
    """p's annotation (the default one when it has none)."""
    return getattr(p, ATTR, _DEFAULT)


def _set(p: torch.Tensor, m: ParamMeta) -> torch.Tensor:
    setattr(p, ATTR, m)
    if m.tp_dim is not None:  # the names DeepSpeed and Megatron look for (grad-norm bookkeeping)
        p.tensor_model_parallel = True
        p.model_parallel = True
        p.partition_dim = m.tp_dim
    return p


def annotate(p: torch.Tensor, **changes) -> torch.Tensor:
    """Set fields of p's annotation (the others keep their values); returns p."""
    return _set(p, dataclasses.replace(meta(p), **changes))


def copy_meta(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst annotated like src (a copy of the same parameter; the annotation is immutable, so it is shared); returns
    dst."""
    return _set(dst, meta(src))


def full_shape(p: torch.Tensor) -> tuple:
    """The unsharded shape of parameter p: its tensor-parallel dimension and its expert dimension multiplied back."""
    m = meta(p)
    shape = list(p.shape)
    if m.tp_dim is not None:
        shape[m.tp_dim] *= m.tp_size
    shape[0] *= m.ep_size
    return tuple(shape)


def shard_offsets(p: torch.Tensor) -> tuple:
    """Where p's block starts in the unsharded tensor (`full_shape(p)`), per dimension: its tensor-parallel block
    along `tp_dim`, its expert-parallel block along dimension 0."""
    m = meta(p)
    offsets = [0] * p.dim()
    if m.tp_dim is not None:
        offsets[m.tp_dim] += m.tp_rank * p.shape[m.tp_dim]
    if m.ep_size > 1:
        offsets[0] += m.ep_rank * p.shape[0]
    return tuple(offsets)
