"""Token dispatch to routed experts and the combine with late routing weights, over the expert-parallel group.

Legend: N tokens (this rank), k experts per token, M = N*k assignments, E experts (global), R expert-parallel
ranks, El = E/R experts on this rank, C capacity (slots per expert per source rank), L latent width.

Two policies (`model.moe_overflow`; the default `auto` takes `drop` under expert parallelism, `dropless` without,
so the default path never reads a value on the host):

- ``drop`` (static shapes). Each assignment gets a slot (expert, position) with position = its rank among the
  assignments to that expert in token order; positions >= C are dropped (not computed, counted). Slots are
  filled by one gather into a fixed [E, C, L] buffer, one `all_to_all_single` with equal splits sends block r
  ([El, C, L]) to EP rank r, the local experts run as one batched GEMM on [El, R*C, L], the reverse all-to-all
  brings the outputs back and one gather combines them. Every shape depends only on N, k, E, C and R, and
  nothing between router and combine reads a value on the host: no `.item()`, `.tolist()`, `.cpu()`, no
  exchange of split sizes. C = ceil(capacity_factor * N * k / E).
- ``dropless``. Rows sorted by expert run through a grouped GEMM with device-side offsets (no host
  synchronisation in one EP rank). Under expert parallelism, only when asked for explicitly (for comparison),
  the per-expert counts are exchanged and the all-to-all uses split sizes, which torch takes as host lists:
  one synchronisation per layer and direction, the one place this module reads device values on the host.

Late routing weights: each expert's output is multiplied by its fp32 routing weight after the expert's down
projection and the k outputs are summed in fp32.
"""

from __future__ import annotations

import math

import torch

from ..parallel.layers import EPContext
from ..parallel.mappings import all_to_all, all_to_all_overlapped
from .norm import atleast_fp32


def capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert (per source rank) for `num_tokens` routed tokens."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def slots(expert_M: torch.Tensor, num_experts: int, cap: int):
    """(slot_M, kept_M): the buffer row e * cap + position of every assignment, or num_experts * cap (a row
    that is thrown away) when its position within the expert is >= cap. Device-only, static shapes."""
    M = expert_M.shape[0]
    order = torch.argsort(expert_M, stable=True)  # assignments grouped by expert, token order inside
    counts_E = torch.bincount(expert_M, minlength=num_experts)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    pos_sorted = torch.arange(M, device=expert_M.device) - start_E[expert_M[order]]
    pos_M = torch.empty_like(pos_sorted).scatter_(0, order, pos_sorted)
    kept_M = pos_M < cap
    slot_M = torch.where(kept_M, expert_M * cap + pos_M, torch.full_like(pos_M, num_experts * cap))
    return slot_M, kept_M


def _static(z_NL, idx_Nk, experts, ep: EPContext, cap: int, side=None):
    N, k = idx_Nk.shape
    L, E = z_NL.shape[-1], experts.num_experts
    M = N * k
    slot_M, kept_M = slots(idx_Nk.reshape(-1), E, cap)
    # source row of every buffer slot: the assignment that owns it, or M (a zero row) when empty
    src = torch.full((E * cap + 1,), M, dtype=torch.long, device=z_NL.device)
    src.scatter_(0, slot_M, torch.arange(M, device=z_NL.device))
    # token-major copies: each row is read by one slot at most, so the backward is collision-free
    z_rows = torch.cat([z_NL.unsqueeze(1).expand(N, k, L).reshape(M, L), z_NL.new_zeros(1, L)])
    buf_ECL = z_rows.index_select(0, src[:E * cap]).view(E, cap, L)
    R, El = ep.size, E // ep.size
    if R > 1:  # block r (experts of rank r) to rank r; receive [R sources, El, C, L]
        send = buf_ECL.reshape(R, El * cap * L)
        if side is None:
            recv = all_to_all(send, ep.group)
        else:  # the side computation (shared experts) runs while the exchange is in flight, both directions
            recv, _ = all_to_all_overlapped(send, ep.group, side)
        recv = recv.view(R, El, cap, L)
        x_ECL = recv.transpose(0, 1).reshape(El, R * cap, L)
    else:
        x_ECL = buf_ECL
    y_ECL = experts.forward_batched(x_ECL)
    if R > 1:
        back = y_ECL.view(El, R, cap, -1).transpose(0, 1).reshape(R, El * cap * y_ECL.shape[-1])
        y_ECL = all_to_all(back, ep.group).view(E, cap, -1)
    y_rows = torch.cat([y_ECL.reshape(E * cap, -1), y_ECL.new_zeros(1, y_ECL.shape[-1])])
    return y_rows.index_select(0, slot_M).view(N, k, -1), kept_M


def _dropless(z_NL, idx_Nk, experts, ep: EPContext):
    N, k = idx_Nk.shape
    L, E = z_NL.shape[-1], experts.num_experts
    expert_M = idx_Nk.reshape(-1)
    order = torch.argsort(expert_M, stable=True)
    counts_E = torch.bincount(expert_M, minlength=E)
    z_rows = z_NL.unsqueeze(1).expand(N, k, L).reshape(N * k, L).index_select(0, order)
    R, El = ep.size, E // ep.size
    if R == 1:
        y_sorted = experts(z_rows, torch.cumsum(counts_E, 0))
    else:
        # counts_RE[r, e]: rows rank r sends to its local expert e of this rank, after the exchange
        recv_counts = all_to_all(counts_E.view(R, El), ep.group)  # [R sources, El]
        send = counts_E.view(R, El).sum(1).tolist()  # host synchronisation: dropless needs split sizes
        recv = recv_counts.sum(1).tolist()
        x = all_to_all(z_rows, ep.group, recv, send)
        # received rows are grouped by source, then by local expert: regroup by local expert
        e_of_row = torch.repeat_interleave(torch.arange(El, device=x.device).repeat(R), recv_counts.reshape(-1))
        regroup = torch.argsort(e_of_row, stable=True)
        y = experts(x.index_select(0, regroup), torch.cumsum(recv_counts.sum(0), 0))
        y = torch.zeros_like(y).index_copy(0, regroup, y)
        y_sorted = all_to_all(y, ep.group, send, recv)
    y_Nk = torch.zeros_like(y_sorted).index_copy(0, order, y_sorted).view(N, k, -1)
    return y_Nk, None


def dispatch_combine(z_NL: torch.Tensor, idx_Nk: torch.Tensor, weight_Nk: torch.Tensor, experts, ep: EPContext,
                     overflow: str, capacity_factor: float, side=None):
    """r_NL = sum_j weight[n, j] * expert_{idx[n, j]}(z[n]) over the kept assignments; returns (r_NL, kept_M or
    None). `experts` holds this rank's El experts. `side`, a callable, is called while the dispatch all-to-all is
    in flight when there is one with static shapes (expert parallelism, drop), and not called otherwise."""
    if overflow == "drop":
        y_Nk, kept = _static(z_NL, idx_Nk, experts, ep, capacity(z_NL.shape[0], idx_Nk.shape[1],
                                                                   experts.num_experts, capacity_factor), side)
    else:
        y_Nk, kept = _dropless(z_NL, idx_Nk, experts, ep)
    r_NL = (atleast_fp32(y_Nk) * weight_Nk.unsqueeze(-1)).sum(1).to(z_NL.dtype)
    return r_NL, kept
