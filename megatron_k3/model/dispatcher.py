"""How a MoE layer's tokens reach its routed experts and come back: the token dispatch and the combine with late
routing weights, with every expert local (`Dispatcher`). megatron_k3.parallel.experts substitutes a dispatcher
that spreads the experts over ranks, built from the same pieces.

Legend: N tokens, k experts per token, M = N*k assignments, E experts, C capacity (slots per expert), L latent.

Two policies (`model.moe_overflow`; the default `auto` takes `dropless` when every expert is local and `drop` when
they are spread over ranks, so the default path never reads a value on the host):

- ``drop`` (static shapes). Each assignment gets a slot (expert, position) with position = its rank among the
  assignments to that expert in token order; positions >= C are dropped (not computed, counted). Slots are filled
  by one gather from the token rows into a fixed [E, C, L] buffer and the experts run as one batched GEMM. Every
  shape depends only on N, k, E and C, and nothing between router and combine reads a value on the host.
  C = ceil(capacity_factor * N * k / E).
- ``dropless``. Rows sorted by expert run through a grouped GEMM with device-side offsets.
- ``balanced`` (expert parallelism: megatron_k3.parallel.balanced) is ``dropless`` with every expert local.

Late routing weights: each expert's output is multiplied by its fp32 routing weight after the expert's down
projection and the k outputs are summed in fp32, by one index_add of the weighted rows into an fp32 [N, L] buffer
(its backward is a gather). The down projection, the weight and the index_add run as one autograd Function
(ops.grouped_gemm.DownCombine) that does not keep the projected rows.
"""

from __future__ import annotations

import math

import torch

__all__ = ["Dispatcher", "capacity", "counts", "positions", "slots", "static_buffer", "sorted_rows", "POLICIES"]

POLICIES = ("auto", "drop", "dropless", "balanced")


def capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert (per source rank) for `num_tokens` routed tokens."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def counts(idx: torch.Tensor, n: int) -> torch.Tensor:
    """[n] int64: how often each of 0..n-1 occurs in idx (ids < n). Equals torch.bincount(idx, minlength=n), whose
    output size depends on the values (so torch.compile cannot give it a static shape)."""
    idx = idx.reshape(-1)
    return torch.zeros(n, dtype=torch.long, device=idx.device).index_add_(0, idx, torch.ones_like(idx))


def positions(expert_M: torch.Tensor, num_experts: int) -> torch.Tensor:
    """pos_M: each assignment's rank among the assignments to its expert, in assignment (token) order."""
    M = expert_M.shape[0]
    order = torch.argsort(expert_M, stable=True)  # assignments grouped by expert, token order inside
    counts_E = counts(expert_M, num_experts)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    pos_sorted = torch.arange(M, device=expert_M.device) - start_E[expert_M[order]]
    return torch.empty_like(pos_sorted).scatter_(0, order, pos_sorted)


def slots(expert_M: torch.Tensor, num_experts: int, cap: int):
    """(slot_M, kept_M): the buffer row e * cap + position of every assignment, or num_experts * cap (a row that is
    thrown away) when its position within the expert is >= cap. Device-only, static shapes."""
    pos_M = positions(expert_M, num_experts)
    kept_M = pos_M < cap
    slot_M = torch.where(kept_M, expert_M * cap + pos_M, torch.full_like(pos_M, num_experts * cap))
    return slot_M, kept_M


def static_buffer(z_NL: torch.Tensor, idx_Nk: torch.Tensor, weight_Nk: torch.Tensor, num_experts: int, cap: int):
    """(buf_ECL, w_S, tok_S, kept_M) of the `drop` policy: every kept assignment's token row in its slot of a fixed
    [E, C, L] buffer, the routing weight of every slot (0 for empty slots) and its token (N for empty slots, a row
    the combine throws away)."""
    N, k = idx_Nk.shape
    L, E, M = z_NL.shape[-1], num_experts, idx_Nk.numel()
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
    return buf_ECL, w_S, tok_S, kept_M


def sorted_rows(z_NL: torch.Tensor, idx_Nk: torch.Tensor, weight_Nk: torch.Tensor, num_experts: int):
    """(z_rows, w_M, tok_M, counts_E) of the `dropless` policy: the token rows of every assignment sorted by expert
    (token order inside), their routing weights and tokens, and the rows per expert."""
    k = idx_Nk.shape[1]
    expert_M = idx_Nk.reshape(-1)
    order = torch.argsort(expert_M, stable=True)
    counts_E = counts(expert_M, num_experts)
    tok_M = order // k  # token of each expert-sorted row
    return z_NL.index_select(0, tok_M), weight_Nk.reshape(-1).index_select(0, order), tok_M, counts_E


class Dispatcher:
    """Routes one MoE layer's tokens to its experts and combines the results, all experts local: every row of the
    layer is routed here (`local_rows` / `all_rows` are the identity), nothing is exchanged."""

    def __init__(self, overflow: str = "auto", capacity_factor: float = 1.25):
        if overflow not in POLICIES:
            raise ValueError(f"model.moe_overflow={overflow!r}; valid: {', '.join(POLICIES)}")
        self.policy = overflow  # model.moe_overflow as asked for; `overflow` is what it resolves to here:
        # auto is one grouped GEMM with device-side offsets (no split sizes, no host synchronisation)
        # (balanced: one rank computes every pair, which is what dropless does)
        self.overflow = "dropless" if overflow in ("auto", "balanced") else overflow
        self.capacity_factor = capacity_factor

    def local_rows(self, x_ND: torch.Tensor) -> torch.Tensor:
        """The rows of the layer input this rank routes."""
        return x_ND

    def all_rows(self, r_NL: torch.Tensor) -> torch.Tensor:
        """The routed result of every row of the layer input, from this rank's rows."""
        return r_NL

    def __call__(self, z_NL: torch.Tensor, idx_Nk: torch.Tensor, weight_Nk: torch.Tensor, experts, side=None):
        """r_NL = sum_j weight[n, j] * expert_{idx[n, j]}(z[n]) over the kept assignments; returns (r_NL, kept_M or
        None). `side`, a callable, is called while an all-to-all is in flight where there is one (never here)."""
        N, k = idx_Nk.shape
        E = experts.num_experts
        if self.overflow == "drop":
            cap = capacity(N, k, E, self.capacity_factor)
            buf_ECL, w_S, tok_S, kept = static_buffer(z_NL, idx_Nk, weight_Nk, E, cap)
            # row N of the result collects the empty slots and is dropped
            r_NL = experts.forward_batched(buf_ECL, combine=(w_S, tok_S, N + 1))[:N]
        else:
            z_rows, w_M, tok_M, counts_E = sorted_rows(z_NL, idx_Nk, weight_Nk, E)
            r_NL, kept = experts(z_rows, torch.cumsum(counts_E, 0, dtype=torch.int32), combine=(w_M, tok_M, N)), None
        return r_NL.to(z_NL.dtype), kept
