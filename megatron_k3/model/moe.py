"""Stable LatentMoE: full-width router, latent down-projection, routed experts (reached through the layer's
dispatcher, dispatcher.py), late routing weights, RMSNorm on the combined latent, up-projection, and shared experts
at full width.

Legend: N tokens, D hidden, L latent (expert width), E experts, k experts per token.
With moe_latent_size = 0 and moe_latent_norm off it is an ordinary DeepSeek/Kimi-Linear MoE.
"""

from __future__ import annotations

import torch
from torch import nn

from .dispatcher import Dispatcher, counts
from .experts import GroupedExperts
from .layers import Linear, recomputing
from .mlp import GatedMLP
from .norm import RMSNorm
from .router import TopKRouter


class StableLatentMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, L = cfg.hidden_size, cfg.expert_width
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.gate = TopKRouter(D, cfg.num_experts, cfg.top_k, cfg.routed_scaling_factor, cfg.norm_topk_prob,
                               cfg.router_num_groups, cfg.router_topk_groups, cfg.router_force_balanced)
        self.latent = bool(cfg.moe_latent_size)
        if self.latent:
            self.latent_down_proj = Linear(D, L, bias=False)
            self.latent_up_proj = Linear(L, D, bias=False)
        self.latent_norm = RMSNorm(L, cfg.rms_norm_eps) if cfg.moe_latent_norm else None
        self.experts = GroupedExperts(cfg.num_experts, L, cfg.moe_intermediate_size, cfg.hidden_act,
                                      cfg.situ_beta_gate, cfg.situ_beta_up)
        self.shared_experts = (GatedMLP(D, cfg.shared_ffn_size, cfg.hidden_act, cfg.situ_beta_gate, cfg.situ_beta_up,
                                        experts=cfg.num_shared_experts) if cfg.num_shared_experts else None)
        self.dispatcher = Dispatcher(cfg.moe_overflow, cfg.moe_capacity_factor)
        # Detached per-expert token counts and dropped assignments of the last forward (this rank's tokens), for
        # load metrics; `balance` (set by the trainer) observes router scores for bias balancing.
        self.register_buffer("tokens_per_expert_E", torch.zeros(cfg.num_experts), persistent=False)
        self.register_buffer("dropped_assignments", torch.zeros(()), persistent=False)
        self.balance = None
        self.pending_observation = None  # (scores, rows) a compiled forward left for `balance`

    def routed(self, x_ND: torch.Tensor, side=None):
        """The routed branch in latent space (before the norm and up-projection) of the rows x_ND; `side` as in
        Dispatcher.__call__."""
        route = self.gate(x_ND)
        first = not recomputing()  # a recomputed pass (activation recomputation) records nothing again
        if self.balance is not None and self.training and torch.is_grad_enabled() and first:
            if torch.compiler.is_compiling():  # a compiled region hands the scores out (flush_observation)
                self.pending_observation = (route.scores_NE.detach(), x_ND.detach())
            else:
                self.balance.observe(route.scores_NE.detach(), self.gate.e_score_correction_bias, x_ND.detach())
        z_NL = self.latent_down_proj(x_ND) if self.latent else x_ND
        r_NL, kept_M = self.dispatcher(z_NL, route.topk_idx_Nk, route.topk_weight_Nk, self.experts, side)
        if first:
            self.tokens_per_expert_E = counts(route.topk_idx_Nk, self.num_experts).to(self.tokens_per_expert_E.dtype)
            self.dropped_assignments = (torch.zeros((), device=x_ND.device) if kept_M is None else
                                        (~kept_M).sum().to(self.dropped_assignments.dtype))
        return r_NL, route

    def flush_observation(self) -> None:
        """Observe the router scores a compiled forward left (megatron_k3.training.compile runs this after each
        compiled layer): Quantile Balancing's statistics are Python state that the compiled code does not touch."""
        pending, self.pending_observation = self.pending_observation, None
        if pending is not None and self.balance is not None and not recomputing():  # once: not a recomputed pass's
            self.balance.observe(pending[0], self.gate.e_score_correction_bias, pending[1])

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        shape = x_BTD.shape
        # The shared experts run while a dispatch all-to-all is in flight (and their backward while the reverse one
        # is): `side` is called by the dispatcher or, where nothing overlaps, below.
        shared = []

        # not `lambda: shared.append(...)`: torch 2.11's Dynamo cannot resume with a bound list method held across
        # the shared experts' graph break (a recomputation region's boundary) and broke the graph there once more
        def run_shared():
            out = self.shared_experts(x_BTD)
            shared.append(out)
        side = run_shared if self.shared_experts is not None else None
        r, _ = self.routed(self.dispatcher.local_rows(x_BTD.reshape(-1, shape[-1])), side)
        r = self.dispatcher.all_rows(r)
        if self.latent_norm is not None:
            r = self.latent_norm(r)
        if self.latent:
            r = self.latent_up_proj(r)
        if self.shared_experts is not None:
            if not shared:
                side()
            r = r + shared[0].reshape(r.shape)
        return r.view(shape)
