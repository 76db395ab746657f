"""Kimi Delta Attention layer: projections, short convolutions, gates, the delta rule, gated output norm.

Legend: B batch, T tokens, D hidden, H heads, K head dim (= V), R decay rank.
q, k = L2Norm(SiLU(Conv4(W x))) per head; v = SiLU(Conv4(W_v x)); decay logit z = W_fb W_fa x;
log-decay g = lb * sigmoid(e^A (z + dt_bias)) (K3) or -e^A softplus(z + dt_bias) (Kimi Linear);
beta = sigmoid(W_b x); out = o_proj( RMSNorm_head(o) * sigmoid(gate(x)) ).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.kda import chunk_kda, recurrent_kda
from ..ops.short_conv import causal_conv1d
from .cache import KDAState
from .norm import compute_dtype, l2norm


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        D, H, K, W = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
        self.layer_idx, self.H, self.K, self.W = layer_idx, H, K, W
        HK = H * K
        self.q_proj = nn.Linear(D, HK, bias=False)
        self.k_proj = nn.Linear(D, HK, bias=False)
        self.v_proj = nn.Linear(D, HK, bias=False)
        # depthwise causal conv filters, nn.Conv1d layout [C, 1, W], kept in fp32
        self.q_conv1d = nn.Parameter(torch.empty(HK, 1, W))
        self.k_conv1d = nn.Parameter(torch.empty(HK, 1, W))
        self.v_conv1d = nn.Parameter(torch.empty(HK, 1, W))
        R = cfg.decay_rank
        self.f_a_proj = nn.Linear(D, R, bias=False)
        self.f_b_proj = nn.Linear(R, HK, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(HK))
        self.b_proj = nn.Linear(D, H, bias=False)
        self.gate_kind = cfg.kda_gate
        self.lower_bound = cfg.kda_gate_lower_bound
        self.lowrank_gate = cfg.kda_output_gate == "lowrank"
        if self.lowrank_gate:
            self.g_a_proj = nn.Linear(D, K, bias=False)
            self.g_b_proj = nn.Linear(K, HK, bias=cfg.kda_output_gate_bias)
        else:
            self.g_proj = nn.Linear(D, HK, bias=False)
        self.o_norm = nn.Parameter(torch.ones(K))  # RMSNorm weight shared by all heads
        self.o_proj = nn.Linear(HK, D, bias=False)
        self.eps = cfg.rms_norm_eps
        self.chunk_size = cfg.kda_chunk_size
        self.a_log_init = cfg.kda_a_log_init

    @torch.no_grad()
    def reset_kda_parameters(self, generator: torch.Generator | None = None):
        """Gate and conv init: A_log = 0 (K3) or log U(1, 16) (fla); dt_bias = inverse-softplus of
        dt ~ logU(1e-3, 1e-1); conv filters as nn.Conv1d (uniform +-1/sqrt(W))."""
        if self.a_log_init == "zero":
            self.A_log.zero_()
        else:
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16, generator=generator).log())
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1), generator=generator)
        dt = dt.exp().clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        bound = 1.0 / math.sqrt(self.W)
        for w in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            w.uniform_(-bound, bound, generator=generator)

    def log_decay(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """Per-step, per-channel log-decay g [B, T, H, K] in fp32."""
        wide = compute_dtype(x_BTD)
        z = self.f_b_proj(self.f_a_proj(x_BTD)).to(wide) + self.dt_bias.to(wide)
        z = z.view(*x_BTD.shape[:2], self.H, self.K)
        a = self.A_log.to(wide).exp()[:, None]
        if self.gate_kind == "lowerbound":
            return self.lower_bound * torch.sigmoid(a * z)
        return -a * F.softplus(z)

    def forward(self, x_BTD: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                state: KDAState | None = None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        H, K = self.H, self.K
        wide = compute_dtype(x_BTD)
        keep = state is not None
        convs = []
        for proj, w, name in ((self.q_proj, self.q_conv1d, "conv_q"), (self.k_proj, self.k_conv1d, "conv_k"),
                              (self.v_proj, self.v_conv1d, "conv_v")):
            y, c = causal_conv1d(proj(x_BTD), w.squeeze(1), getattr(state, name) if keep else None,
                                 cu_seqlens=cu_seqlens, activation="silu", output_cache=keep)
            if keep:
                setattr(state, name, c)
            convs.append(y.view(B, T, H, K))
        q, k, v = convs
        q, k = l2norm(q, 1e-6), l2norm(k, 1e-6)
        g = self.log_decay(x_BTD)
        beta = torch.sigmoid(self.b_proj(x_BTD).to(wide))
        init = state.recurrent if keep else None
        if keep and init is not None and T <= 4:  # decode: the plain recurrence is the cheapest form
            o, S = recurrent_kda(q, k, v, g, beta, initial_state=init, output_final_state=True)
        else:
            o, S = chunk_kda(q, k, v, g, beta, initial_state=init, output_final_state=keep,
                             chunk_size=self.chunk_size, cu_seqlens=cu_seqlens,
                             lower_bound=self.lower_bound if self.gate_kind == "lowerbound" else None)
        if keep:
            state.recurrent = S
        gate = self.g_b_proj(self.g_a_proj(x_BTD)) if self.lowrank_gate else self.g_proj(x_BTD)
        of = o.to(wide)
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.to(wide)
        of = of * torch.sigmoid(gate.to(wide).view(B, T, H, K))
        return self.o_proj(of.to(x_BTD.dtype).reshape(B, T, H * K))
