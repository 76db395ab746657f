"""The routed MoE branch under tensor and expert parallelism, applied from outside: `apply_expert_parallel(model,
tp, ep)` gives each EP rank its block of every MoE layer's experts and substitutes a `ParallelDispatcher` for the
layer's single-device one.

Legend: N tokens (this rank), k experts per token, E experts (global), R expert-parallel ranks, El = E/R experts on
this rank, C capacity (slots per expert per source rank), L latent width.

Tensor parallelism: every TP rank routes its own 1/tp of the tokens (its sequence shard under sequence
parallelism, else its block of rows: `local_rows` keeps them, `all_rows` gathers the results), so no expert
computes a token twice. The router, the latent projections and (with all experts on every rank) the experts see
only this rank's tokens: their gradients are summed over TP by hooks.

Expert parallelism (EP group of R ranks, inside one supernode):
- ``drop`` (static shapes, the default under ep > 1): the [E, C, L] slot buffer of model.dispatcher goes out in one
  `all_to_all_single` with equal splits (block r, [El, C, L], to EP rank r), the local experts run as one batched
  GEMM on [El, R*C, L], the reverse all-to-all brings the outputs back and one weighted index_add combines them.
  Every shape depends only on N, k, E, C and R, and nothing between router and combine reads a value on the host.
  The shared experts run while the dispatch exchange is in flight (and their backward while the reverse one is).
- ``balanced``: redundant experts so every EP rank computes exactly the same number of pairs, nothing dropped, fixed
  buffers, no host read (megatron_k3.parallel.balanced).
- ``dropless`` (only when asked for, for comparison): the per-expert counts are exchanged and the all-to-all uses
  split sizes, which torch takes as host lists: one synchronisation per layer and direction, the one place the
  MoE path reads device values on the host.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..annotations import annotate, copy_meta
from ..layout import default_replica_slots
from ..model.dispatcher import POLICIES, Dispatcher, capacity, sorted_rows, static_buffer
from ..model.moe import StableLatentMoE
from ..ops.grouped_gemm import weighted_combine
from .balanced import BalancedDispatch
from .mappings import Group, all_to_all, all_to_all_overlapped, gather_rows, split_rows
from .tensor import TensorParallel, block_copy, mark_partial_grad

__all__ = ["ParallelDispatcher", "apply_expert_parallel", "resolve_overflow"]

log = logging.getLogger("megatron_k3.moe")


def resolve_overflow(policy: str, expert_parallel: bool) -> str:
    """model.moe_overflow=auto: the static-shape `drop` dispatch under expert parallelism (no host synchronisation
    between router and combine), `dropless` without it (one grouped GEMM with device-side offsets: no split sizes,
    no host synchronisation either)."""
    if policy not in POLICIES:
        raise ValueError(f"model.moe_overflow={policy!r}; valid: {', '.join(POLICIES)}")
    if policy == "auto":
        return "drop" if expert_parallel else "dropless"
    if policy == "balanced" and not expert_parallel:
        return "dropless"  # one EP rank computes every pair: balanced by construction
    return policy


class ParallelDispatcher(Dispatcher):
    """A MoE layer's dispatch under tensor parallelism (each TP rank routes its rows) and expert parallelism (this
    rank holds experts [rank * E/R, (rank + 1) * E/R); the all-to-all runs over the EP group)."""

    def __init__(self, overflow: str, capacity_factor: float, tp: TensorParallel, ep: Group,
                 redundant_experts: int | None = None, num_experts: int | None = None):
        super().__init__(overflow, capacity_factor)
        self.overflow = resolve_overflow(overflow, expert_parallel=ep.size > 1)
        self.balanced = None
        if self.overflow == "balanced":
            slots = default_replica_slots(num_experts, ep.size) if redundant_experts is None else redundant_experts
            self.balanced = BalancedDispatch(ep.group, ep.size, ep.rank, slots)
        if overflow == "dropless" and ep.size > 1:
            log.warning("model.moe_overflow=dropless with parallel.ep=%d: the all-to-all needs split sizes on the host "
                        "(one synchronisation per MoE layer and direction); drop or auto keeps shapes static", ep.size)
        self.tp, self.ep = tp, ep
        self._split = False

    def local_rows(self, x_ND: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        self._split = tp.size > 1 and not tp.sequence_parallel
        if self._split and x_ND.shape[0] % tp.size:
            if torch.is_grad_enabled() or self.ep.size > 1:
                raise ValueError(f"{x_ND.shape[0]} tokens cannot be split over {tp.size} tensor-parallel ranks "
                                 f"for routing")
            self._split = False  # inference on a few tokens: route them on every rank
        return split_rows(x_ND, tp.group) if self._split else x_ND

    def all_rows(self, r_NL: torch.Tensor) -> torch.Tensor:
        return gather_rows(r_NL, self.tp.group) if self._split else r_NL

    def __call__(self, z_NL, idx_Nk, weight_Nk, experts, side=None):
        if self.ep.size == 1:
            return super().__call__(z_NL, idx_Nk, weight_Nk, experts, side)
        if self.overflow == "drop":
            r_NL, kept = self._static(z_NL, idx_Nk, weight_Nk, experts, side)
        elif self.balanced is not None:
            r_NL, kept = self.balanced(z_NL, idx_Nk, weight_Nk, experts, side), None
        else:
            r_NL, kept = self._dropless(z_NL, idx_Nk, weight_Nk, experts)
        return r_NL.to(z_NL.dtype), kept

    def _static(self, z_NL, idx_Nk, weight_Nk, experts, side):
        N, k = idx_Nk.shape
        E, group = experts.num_experts, self.ep.group
        cap = capacity(N, k, E, self.capacity_factor)
        buf_ECL, w_S, tok_S, kept_M = static_buffer(z_NL, idx_Nk, weight_Nk, E, cap)
        L = buf_ECL.shape[-1]
        R, El = self.ep.size, E // self.ep.size
        # block r (experts of rank r) to rank r; receive [R sources, El, C, L]
        send = buf_ECL.reshape(R, El * cap * L)
        if side is None:
            recv = all_to_all(send, group)
        else:  # the side computation (shared experts) runs while the exchange is in flight, both directions
            recv, _ = all_to_all_overlapped(send, group, side)
        y_ECL = experts.forward_batched(recv.view(R, El, cap, L).transpose(0, 1).reshape(El, R * cap, L))
        back = y_ECL.view(El, R, cap, -1).transpose(0, 1).reshape(R, El * cap * y_ECL.shape[-1])
        y_ECL = all_to_all(back, group).view(E, cap, -1)
        return weighted_combine(y_ECL.reshape(E * cap, -1), w_S, tok_S, N + 1)[:N], kept_M

    def _dropless(self, z_NL, idx_Nk, weight_Nk, experts):
        N = idx_Nk.shape[0]
        E, group = experts.num_experts, self.ep.group
        z_rows, w_M, tok_M, counts_E = sorted_rows(z_NL, idx_Nk, weight_Nk, E)
        R, El = self.ep.size, E // self.ep.size
        # counts_RE[r, e]: rows rank r sends to its local expert e of this rank, after the exchange
        recv_counts = all_to_all(counts_E.view(R, El), group)  # [R sources, El]
        send = counts_E.view(R, El).sum(1).tolist()  # host synchronisation: dropless needs split sizes
        recv = recv_counts.sum(1).tolist()
        x = all_to_all(z_rows, group, recv, send)
        # received rows are grouped by source, then by local expert: regroup by local expert
        e_of_row = torch.repeat_interleave(torch.arange(El, device=x.device).repeat(R), recv_counts.reshape(-1))
        regroup = torch.argsort(e_of_row, stable=True)
        y = experts(x.index_select(0, regroup), torch.cumsum(recv_counts.sum(0), 0))
        y = torch.zeros_like(y).index_copy(0, regroup, y)
        y_sorted = all_to_all(y, group, send, recv)
        return weighted_combine(y_sorted, w_M, tok_M, N), None


def _shard_experts(experts, ep: Group) -> None:
    """Keep this EP rank's block of experts [rank * E/R, (rank + 1) * E/R) of every weight (global names, order)."""
    if experts.num_experts % ep.size:
        raise ValueError(f"num_experts={experts.num_experts} is not divisible by the expert-parallel size {ep.size}")
    for name in ("w1", "w3", "w2"):
        full = getattr(experts, name)
        local = nn.Parameter(block_copy(full.detach().chunk(ep.size, 0)[ep.rank]), requires_grad=full.requires_grad)
        setattr(experts, name, annotate(copy_meta(full, local), ep_size=ep.size, ep_rank=ep.rank))
    experts.expert_offset = ep.rank * experts.num_local


def apply_expert_parallel(module: nn.Module, tp: TensorParallel, ep: Group,
                          redundant_experts: int | None = None) -> nn.Module:
    """Every MoE layer in `module` (a model, or one layer; unsharded experts) under the TP and EP groups, in place;
    returns it. `redundant_experts`: the replica slots per EP rank of model.moe_overflow=balanced (None: E/ep)."""
    for moe in [m for m in module.modules() if isinstance(m, StableLatentMoE)]:
        if ep.size > 1:
            _shard_experts(moe.experts, ep)
        if tp.size > 1:  # replicated weights that see this rank's tokens only: gradients summed over TP
            for name, p in moe.named_parameters():
                if name.startswith("shared_experts.") or (name.startswith("experts.") and ep.size > 1):
                    continue  # split Megatron-style / distinct experts, reduced over expert data parallel
                if tp.sequence_parallel or not name.startswith(("latent_norm.", "latent_up_proj.")):
                    mark_partial_grad(p, tp)
        if tp.size > 1 or ep.size > 1:
            d = moe.dispatcher
            moe.dispatcher = ParallelDispatcher(d.policy, d.capacity_factor, tp, ep, redundant_experts,
                                                moe.num_experts)
    return module
