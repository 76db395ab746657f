"""Token dispatch to routed experts and the combine with late routing weights, over the expert-parallel group.

Legend: N tokens (this rank), k experts per token, M = N*k assignments, E experts (global), R expert-parallel
ranks, El = E/R experts on this rank, C capacity (slots per expert per source rank), L latent width.

Two policies (`model.moe_overflow`; the default `auto` takes `drop` under expert parallelism, `dropless` without,
so the default path never reads a value on the host):

- ``drop`` (static shapes). Each assignment gets a slot (expert, position) with position = its rank among the
  assignments to that expert in token order; positions >= C are dropped (not computed, counted). Slots are
  filled by one gather from the token rows into a fixed [E, C, L] buffer, one `all_to_all_single` with equal
  splits sends block r ([El, C, L]) to EP rank r, the local experts run as one batched GEMM on [El, R*C, L], the
  reverse all-to-all brings the outputs back and one weighted index_add combines them. Every shape depends only
  on N, k, E, C and R, and nothing between router and combine reads a value on the host: no `.item()`,
  `.tolist()`, `.cpu()`, no exchange of split sizes. C = ceil(capacity_factor * N * k / E).
- ``dropless``. Rows sorted by expert run through a grouped GEMM with device-side offsets (no host
  synchronisation in one EP rank). Under expert parallelism, only when asked for explicitly (for comparison),
  the per-expert counts are exchanged and the all-to-all uses split sizes, which torch takes as host lists:
  one synchronisation per layer and direction, the one place this module reads device values on the host.

Late routing weights: each expert's output is multiplied by its fp32 routing weight after the expert's down
projection and the k outputs are summed in fp32, by one index_add of the weighted rows into an fp32 [N, L]
buffer (its backward is a gather). On one EP rank the down projection, the weight and the index_add run as one
autograd Function (experts._DownCombine) that does not keep the projected rows.
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


def _static(z_NL, idx_Nk, weight_Nk, experts, ep: EPContext, cap: int, side=None):
    N, k = idx_Nk.shape
    L, E = z_NL.shape[-1], experts.num_experts
    M = N * k
    slot_M, kept_M = slots(idx_Nk.reshape(-1), E, cap)
    # source assignment of every buffer slot, or M when the slot is empty (dropped ones land on slot E * cap)
    src = torch.full((E * cap + 1,), M, dtype=torch.long, device=z_NL.device)
    src = src.scatter_(0, slot_M, torch.arange(M, device=z_NL.device))[:E * cap]
    tok_S = src // k  # token of each slot; N (a zero row, then a discarded one) for empty slots
    # gather the slots from the N token rows plus one zero row; a token's k slots are distinct rows, so the
    # backward (index_add) sums its k gradients
    z_rows = torch.cat([z_NL, z_NL.new_zeros(1, L)])
    buf_ECL = z_rows.index_select(0, tok_S).view(E, cap, L)
    w_S = torch.cat([weight_Nk.reshape(-1), weight_Nk.new_zeros(1)]).index_select(0, src)  # 0 for empty slots
    R, El = ep.size, E // ep.size
    if R == 1:  # row N of the result collects the empty slots and is dropped
        return experts.forward_batched(buf_ECL, combine=(w_S, tok_S, N + 1))[:N], kept_M
    # block r (experts of rank r) to rank r; receive [R sources, El, C, L]
    send = buf_ECL.reshape(R, El * cap * L)
    if side is None:
        recv = all_to_all(send, ep.group)
    else:  # the side computation (shared experts) runs while the exchange is in flight, both directions
        recv, _ = all_to_all_overlapped(send, ep.group, side)
    y_ECL = experts.forward_batched(recv.view(R, El, cap, L).transpose(0, 1).reshape(El, R * cap, L))
    back = y_ECL.view(El, R, cap, -1).transpose(0, 1).reshape(R, El * cap * y_ECL.shape[-1])
    y_ECL = all_to_all(back, ep.group).view(E, cap, -1)
    return _combine(y_ECL.reshape(E * cap, -1), w_S, tok_S, N + 1)[:N], kept_M


def _dropless(z_NL, idx_Nk, weight_Nk, experts, ep: EPContext):
    N, k = idx_Nk.shape
    E = experts.num_experts
    expert_M = idx_Nk.reshape(-1)
    order = torch.argsort(expert_M, stable=True)
    counts_E = torch.bincount(expert_M, minlength=E)
    tok_M = order // k  # token of each expert-sorted row
    z_rows = z_NL.index_select(0, tok_M)
    w_M = weight_Nk.reshape(-1).index_select(0, order)
    R, El = ep.size, E // ep.size
    if R == 1:
        return experts(z_rows, torch.cumsum(counts_E, 0, dtype=torch.int32), combine=(w_M, tok_M, N)), None
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
    return _combine(y_sorted, w_M, tok_M, N), None


def _combine(y_SL: torch.Tensor, w_S: torch.Tensor, tok_S: torch.Tensor, num_rows: int) -> torch.Tensor:
    """r[t] = sum over rows s with tok_S[s] = t of w_S[s] * y[s], in fp32: one weighted index_add into [num_rows,
    L] (its backward is a gather), instead of un-sorting the rows into [N, k, L] and reducing over k."""
    out = torch.zeros(num_rows, y_SL.shape[-1], dtype=torch.promote_types(y_SL.dtype, torch.float32),
                      device=y_SL.device)
    return out.index_add_(0, tok_S, atleast_fp32(y_SL) * w_S.unsqueeze(-1))


def dispatch_combine(z_NL: torch.Tensor, idx_Nk: torch.Tensor, weight_Nk: torch.Tensor, experts, ep: EPContext,
                     overflow: str, capacity_factor: float, side=None):
    """r_NL = sum_j weight[n, j] * expert_{idx[n, j]}(z[n]) over the kept assignments; returns (r_NL, kept_M or
    None). `experts` holds this rank's El experts. `side`, a callable, is called while the dispatch all-to-all is
    in flight when there is one with static shapes (expert parallelism, drop), and not called otherwise."""
    if overflow == "drop":
        r_NL, kept = _static(z_NL, idx_Nk, weight_Nk, experts, ep, capacity(z_NL.shape[0], idx_Nk.shape[1],
                                                                              experts.num_experts, capacity_factor),
                             side)
    else:
        r_NL, kept = _dropless(z_NL, idx_Nk, weight_Nk, experts, ep)
    return r_NL.to(z_NL.dtype), kept
