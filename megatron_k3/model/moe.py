"""Stable LatentMoE: full-width router, latent down-projection, routed experts (dispatched over the
expert-parallel group, dispatcher.py), late routing weights, RMSNorm on the combined latent, up-projection,
and shared experts at full width.

Legend: N tokens, D hidden, L latent (expert width), E experts, k experts per token.
With moe_latent_size = 0 and moe_latent_norm off it is an ordinary DeepSeek/Kimi-Linear MoE.

Under tensor parallelism every TP rank routes its own 1/tp of the tokens (its sequence shard under sequence
parallelism, else its block of rows), so no expert computes a token twice, and the routed results are
gathered back; the shared experts are split Megatron-style like any MLP.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..parallel.layers import current_ep, current_tp, mark_partial_grad
from ..parallel.mappings import gather_rows, split_rows
from .dispatcher import dispatch_combine
from .experts import GroupedExperts
from .norm import RMSNorm
from .router import TopKRouter
from .situ import GatedMLP


log = logging.getLogger("megatron_k3.moe")


def resolve_overflow(policy: str, ep_size: int) -> str:
    """model.moe_overflow=auto: the static-shape `drop` dispatch under expert parallelism (no host synchronisation
    between router and combine), `dropless` without it (one grouped GEMM with device-side offsets: no split sizes,
    no host synchronisation either). An explicit `dropless` under ep > 1 exchanges split sizes through the host."""
    if policy == "auto":
        return "drop" if ep_size > 1 else "dropless"
    if policy == "dropless" and ep_size > 1:
        log.warning("model.moe_overflow=dropless with parallel.ep=%d: the all-to-all needs split sizes on the host "
                    "(one synchronisation per MoE layer and direction); drop or auto keeps shapes static", ep_size)
    return policy


class StableLatentMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tp = tp = current_tp()
        self.ep = ep = current_ep()
        self.overflow, self.capacity_factor = resolve_overflow(cfg.moe_overflow, ep.size), cfg.moe_capacity_factor
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
                                      cfg.situ_beta_gate, cfg.situ_beta_up, ep=ep)
        self.shared_experts = (GatedMLP(D, cfg.shared_ffn_size, cfg.hidden_act, cfg.situ_beta_gate, cfg.situ_beta_up,
                                        tp=tp, experts=cfg.num_shared_experts) if cfg.num_shared_experts else None)
        if tp.size > 1:  # replicated weights that see this rank's tokens only: gradients summed over TP
            for name, p in self.named_parameters():
                if name.startswith("shared_experts.") or (name.startswith("experts.") and ep.size > 1):
                    continue  # split Megatron-style / distinct experts, reduced over expert data parallel
                if tp.sequence_parallel or not name.startswith(("latent_norm.", "latent_up_proj.")):
                    mark_partial_grad(p)
        # Detached per-expert token counts and dropped assignments of the last forward (this rank's tokens),
        # for load metrics; `balance` (set by the trainer) observes router scores for bias balancing.
        self.register_buffer("tokens_per_expert_E", torch.zeros(cfg.num_experts), persistent=False)
        self.register_buffer("dropped_assignments", torch.zeros(()), persistent=False)
        self.balance = None

    def routed(self, x_ND: torch.Tensor, side=None):
        """The routed branch in latent space (before the norm and up-projection), for this rank's tokens; `side`
        as in dispatch_combine."""
        route = self.gate(x_ND)
        if self.balance is not None and self.training and torch.is_grad_enabled() and \
                torch._C._current_graph_task_id() == -1:  # real forward passes only, not a recomputation
            self.balance.observe(route.scores_NE.detach(), self.gate.e_score_correction_bias, x_ND.detach())
        z_NL = self.latent_down_proj(x_ND) if self.latent else x_ND
        r_NL, kept_M = dispatch_combine(z_NL, route.topk_idx_Nk, route.topk_weight_Nk, self.experts, self.ep,
                                        self.overflow, self.capacity_factor, side)
        self.tokens_per_expert_E = torch.bincount(route.topk_idx_Nk.reshape(-1), minlength=self.num_experts
                                                  ).detach().to(self.tokens_per_expert_E.dtype)
        self.dropped_assignments = (torch.zeros((), device=x_ND.device) if kept_M is None else
                                    (~kept_M).sum().to(self.dropped_assignments.dtype))
        return r_NL, route

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        shape = x_BTD.shape
        x_ND = x_BTD.reshape(-1, shape[-1])
        tp = self.tp
        split = tp.size > 1 and not tp.sequence_parallel
        if split and x_ND.shape[0] % tp.size:
            if torch.is_grad_enabled() or self.ep.size > 1:
                raise ValueError(f"{x_ND.shape[0]} tokens cannot be split over {tp.size} tensor-parallel ranks "
                                 f"for routing")
            split = False  # inference on a few tokens: route them on every rank
        # Under expert parallelism the shared experts run while the dispatch all-to-all is in flight (and their
        # backward while the reverse one is): `side` is called by the dispatcher or, where nothing overlaps, below.
        shared = []
        side = (lambda: shared.append(self.shared_experts(x_BTD))) if self.shared_experts is not None else None
        if split:
            r, _ = self.routed(split_rows(x_ND, tp.group), side)
            r = gather_rows(r, tp.group)
        else:
            r, _ = self.routed(x_ND, side)
        if self.latent_norm is not None:
            r = self.latent_norm(r)
        if self.latent:
            r = self.latent_up_proj(r)
        if self.shared_experts is not None:
            if not shared:
                side()
            r = r + shared[0].reshape(r.shape)
        return r.view(shape)
