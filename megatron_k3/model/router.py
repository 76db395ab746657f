"""Sigmoid top-k router with a selection-only correction bias (DeepSeek-V3 `noaux_tc` lineage, as in K3).

Legend: N tokens, D hidden, E experts, k experts per token, G router groups.
scores = sigmoid(x W^T) in fp32 on the full-width token (a bf16 autocast around the forward included); experts are
chosen by top-k of (scores + bias), weighted by the chosen raw scores, renormalised, times routed_scaling_factor.
The bias only selects; it is updated outside autograd (Quantile Balancing) and stays fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.numerics import compute_dtype, without_autocast


@dataclass
class Routing:
    scores_NE: torch.Tensor  # sigmoid scores, fp32
    topk_idx_Nk: torch.Tensor  # chosen experts
    topk_weight_Nk: torch.Tensor  # combine weights, fp32


class TopKRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, routed_scaling_factor: float = 1.0,
                 norm_topk_prob: bool = True, num_groups: int = 1, topk_groups: int = 1,
                 force_balanced: bool = False):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.routed_scaling_factor, self.norm_topk_prob = routed_scaling_factor, norm_topk_prob
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.force_balanced = force_balanced
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        # Mean over the last forward's tokens of the entropy of the scores normalised over the experts, divided
        # by log(num_experts): 1 = uniform, 0 = one expert. Detached, on device (no host sync), for metrics.
        self.last_entropy: torch.Tensor | None = None

    def select(self, scores_NE: torch.Tensor) -> torch.Tensor:
        """Indices of the chosen experts from the biased scores (group-limited when num_groups > 1)."""
        choice = scores_NE + self.e_score_correction_bias
        if self.num_groups > 1:
            N = choice.shape[0]
            grouped = choice.view(N, self.num_groups, -1)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = group_score.topk(self.topk_groups, dim=-1).indices
            mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~mask[..., None], float("-inf")).view(N, -1)
        return choice.topk(self.top_k, dim=-1).indices

    def forward(self, x_ND: torch.Tensor) -> Routing:
        wide = compute_dtype(x_ND)
        with without_autocast(x_ND.device.type):  # fp32 under a bf16 autocast too (it would run the GEMM in bf16)
            scores = torch.sigmoid(F.linear(x_ND.to(wide), self.weight.to(wide)))
        if self.force_balanced:  # debug knob: round-robin, every expert gets the same number of tokens
            N = scores.shape[0]
            base = torch.arange(N, device=scores.device)[:, None] * self.top_k
            idx = (base + torch.arange(self.top_k, device=scores.device)) % self.num_experts
        else:
            idx = self.select(scores.detach())
        with torch.no_grad():
            p = scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)
            ent = -(p * p.clamp_min(1e-20).log()).sum(-1).mean()
            self.last_entropy = ent / math.log(self.num_experts) if self.num_experts > 1 else ent
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return Routing(scores, idx, w * self.routed_scaling_factor)
