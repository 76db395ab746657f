"""Stable LatentMoE: full-width router, latent down-projection, routed experts, late routing weights,
RMSNorm on the combined latent, up-projection, and shared experts at full width.

Legend: N tokens, D hidden, L latent (expert width), E experts, k experts per token.
With moe_latent_size = 0 and moe_latent_norm off it is an ordinary DeepSeek/Kimi-Linear MoE.
"""

from __future__ import annotations

import torch
from torch import nn

from .experts import GroupedExperts
from ..parallel.layers import current_tp, mark_partial_grad
from .norm import RMSNorm, atleast_fp32
from .router import TopKRouter
from .situ import GatedMLP


class StableLatentMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tp = tp = current_tp()
        D, L = cfg.hidden_size, cfg.expert_width
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.gate = TopKRouter(D, cfg.num_experts, cfg.top_k, cfg.routed_scaling_factor, cfg.norm_topk_prob,
                               cfg.router_num_groups, cfg.router_topk_groups, cfg.router_force_balanced)
        self.latent = bool(cfg.moe_latent_size)
        if self.latent:
            self.latent_down_proj = nn.Linear(D, L, bias=False)
            self.latent_up_proj = nn.Linear(L, D, bias=False)
        self.latent_norm = RMSNorm(L, cfg.rms_norm_eps) if cfg.moe_latent_norm else None
        self.experts = GroupedExperts(cfg.num_experts, L, cfg.moe_intermediate_size, cfg.hidden_act,
                                      cfg.situ_beta_gate, cfg.situ_beta_up)
        self.shared_experts = (GatedMLP(D, cfg.shared_ffn_size, cfg.hidden_act, cfg.situ_beta_gate, cfg.situ_beta_up,
                                        tp=tp, experts=cfg.num_shared_experts) if cfg.num_shared_experts else None)
        if tp.size > 1 and tp.sequence_parallel:  # replicated weights applied to this rank's tokens only
            for name, p in self.named_parameters():
                if not name.startswith("shared_experts."):
                    mark_partial_grad(p)
        # Detached per-expert token counts of the last forward, for load metrics and balancing.
        self.register_buffer("tokens_per_expert_E", torch.zeros(cfg.num_experts), persistent=False)

    def routed(self, x_ND: torch.Tensor):
        """The routed branch in latent space (before the norm and up-projection)."""
        N, k = x_ND.shape[0], self.top_k
        route = self.gate(x_ND)
        z_NL = self.latent_down_proj(x_ND) if self.latent else x_ND
        expert_Nk = route.topk_idx_Nk.reshape(-1)
        order = torch.argsort(expert_Nk, stable=True)  # rows grouped by expert, tokens in order
        counts_E = torch.bincount(expert_Nk, minlength=self.num_experts)
        offs_E = torch.cumsum(counts_E, 0)
        # Gather by a permutation of the token-major copies: each row is read once, so the backward is a
        # collision-free scatter plus a sum over k (deterministic), unlike indexing with repeated rows.
        z_rep = z_NL.unsqueeze(1).expand(N, k, z_NL.shape[-1]).reshape(N * k, -1)
        y_sorted = self.experts(z_rep.index_select(0, order), offs_E)
        y_Nk = torch.zeros_like(y_sorted).index_copy(0, order, y_sorted).view(N, k, -1)
        # late routing weights: each expert's output is weighted after its down projection, summed in fp32
        r_NL = (atleast_fp32(y_Nk) * route.topk_weight_Nk.unsqueeze(-1)).sum(1).to(x_ND.dtype)
        self.tokens_per_expert_E = counts_E.detach().to(self.tokens_per_expert_E.dtype)
        return r_NL, route

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        shape = x_BTD.shape
        x_ND = x_BTD.reshape(-1, shape[-1])
        r, _ = self.routed(x_ND)
        if self.latent_norm is not None:
            r = self.latent_norm(r)
        if self.latent:
            r = self.latent_up_proj(r)
        if self.shared_experts is not None:
            r = r + self.shared_experts(x_BTD).reshape(r.shape)
        return r.view(shape)
