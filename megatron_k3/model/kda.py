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
from ..parallel.context import SequenceShard, conv_context_parallel, kda_context_parallel
from ..parallel.layers import (ColumnParallelLinear, RowParallelLinear, current_tp, mark_head_blocks,
                               mark_partial_grad, mark_sharded)
from .cache import KDAState
from .norm import compute_dtype, l2norm


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.tp = tp = current_tp()
        D, K, W = cfg.hidden_size, cfg.kda_head_dim, cfg.kda_conv_size
        H = tp.divide(cfg.kda_num_heads, "model.kda_num_heads")  # this rank's heads
        self.layer_idx, self.H, self.K, self.W = layer_idx, H, K, W
        HK_full = cfg.kda_num_heads * K
        self.q_proj = ColumnParallelLinear(D, HK_full, tp=tp)
        self.k_proj = ColumnParallelLinear(D, HK_full, tp=tp)
        self.v_proj = ColumnParallelLinear(D, HK_full, tp=tp)
        # depthwise causal conv filters, nn.Conv1d layout [C, 1, W], kept in fp32; split with the heads
        self.q_conv1d = mark_sharded(nn.Parameter(torch.empty(H * K, 1, W)), 0)
        self.k_conv1d = mark_sharded(nn.Parameter(torch.empty(H * K, 1, W)), 0)
        self.v_conv1d = mark_sharded(nn.Parameter(torch.empty(H * K, 1, W)), 0)
        R = cfg.decay_rank
        self.f_a_proj = ColumnParallelLinear(D, R, gather_output=True, tp=tp)  # the low-rank bottleneck stays whole
        self.f_b_proj = ColumnParallelLinear(R, HK_full, tp=tp)
        self.A_log = mark_sharded(nn.Parameter(torch.empty(H)), 0)
        self.dt_bias = mark_sharded(nn.Parameter(torch.empty(H * K)), 0)
        self.b_proj = ColumnParallelLinear(D, cfg.kda_num_heads, tp=tp)
        self.gate_kind = cfg.kda_gate
        self.lower_bound = cfg.kda_gate_lower_bound
        self.lowrank_gate = cfg.kda_output_gate == "lowrank"
        if self.lowrank_gate:
            self.g_a_proj = ColumnParallelLinear(D, K, gather_output=True, tp=tp)
            self.g_b_proj = ColumnParallelLinear(K, HK_full, bias=cfg.kda_output_gate_bias, tp=tp)
        else:
            self.g_proj = ColumnParallelLinear(D, HK_full, tp=tp)
        self.o_norm = nn.Parameter(torch.ones(K))  # RMSNorm weight shared by all heads
        if tp.size > 1:
            mark_partial_grad(self.o_norm)  # each rank applies it to its own heads only
        self.o_proj = RowParallelLinear(HK_full, D, tp=tp)
        # Per-Head Muon: q/k/v/output-gate rows and o_proj columns are head blocks (the low-rank f/g stay whole)
        for proj in (self.q_proj, self.k_proj, self.v_proj) + (() if self.lowrank_gate else (self.g_proj,)):
            mark_head_blocks(proj.weight, cfg.kda_num_heads, axis=0)
        mark_head_blocks(self.o_proj.weight, cfg.kda_num_heads, axis=1)
        self.eps = cfg.rms_norm_eps
        self.chunk_size = cfg.kda_chunk_size
        self.a_log_init = cfg.kda_a_log_init

    def init_full(self, name: str, shape, generator=None):
        """Initial value of the full (unsharded) parameter `name`: A_log = 0 (K3) or log U(1, 16) (fla);
        dt_bias = inverse-softplus of dt ~ logU(1e-3, 1e-1); conv filters as nn.Conv1d (uniform +-1/sqrt(W));
        o_norm ones. None for the projections (the model's normal init)."""
        if name == "A_log":
            if self.a_log_init == "zero":
                return torch.zeros(shape)
            return torch.empty(shape).uniform_(1, 16, generator=generator).log()
        if name == "dt_bias":
            dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp().clamp_min(1e-4)
            return dt + torch.log(-torch.expm1(-dt))
        if name.endswith("conv1d"):
            bound = 1.0 / math.sqrt(self.W)
            return torch.empty(shape).uniform_(-bound, bound, generator=generator)
        if name == "o_norm":
            return torch.ones(shape)
        return None

    def log_decay(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """Per-step, per-channel log-decay g [B, T, H, K] in fp32."""
        wide = compute_dtype(x_BTD)
        z = self.f_b_proj(self.tp.copy(self.f_a_proj(x_BTD))).to(wide) + self.dt_bias.to(wide)
        z = z.view(*x_BTD.shape[:2], self.H, self.K)
        a = self.A_log.to(wide).exp()[:, None]
        if self.gate_kind == "lowerbound":
            return self.lower_bound * torch.sigmoid(a * z)
        return -a * F.softplus(z)

    def forward(self, x_BTD: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                state: KDAState | None = None, context: SequenceShard | None = None) -> torch.Tensor:
        """context: this rank's share of a context-parallel sequence (T is then the local token count; the
        conv halos and the recurrent state are exchanged over the CP group, see parallel/context.py)."""
        x_BTD = self.tp.enter(x_BTD)  # whole sequence on every TP rank; this rank's heads below
        B, T, _ = x_BTD.shape
        H, K = self.H, self.K
        wide = compute_dtype(x_BTD)
        keep = state is not None
        if context is not None and keep:
            raise ValueError("context parallelism is for training and prefill without a decode cache")
        convs = []
        for proj, w, name in ((self.q_proj, self.q_conv1d, "conv_q"), (self.k_proj, self.k_conv1d, "conv_k"),
                              (self.v_proj, self.v_conv1d, "conv_v")):
            if context is not None:
                y = conv_context_parallel(causal_conv1d, proj(x_BTD), w.squeeze(1), context, activation="silu")
            else:
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
        lb = self.lower_bound if self.gate_kind == "lowerbound" else None
        if context is not None:
            o = kda_context_parallel(chunk_kda, q, k, v, g, beta, context, chunk_size=self.chunk_size, lower_bound=lb)
        elif keep and init is not None and T <= 4:  # decode: the plain recurrence is the cheapest form
            o, S = recurrent_kda(q, k, v, g, beta, initial_state=init, output_final_state=True)
        else:
            o, S = chunk_kda(q, k, v, g, beta, initial_state=init, output_final_state=keep,
                             chunk_size=self.chunk_size, cu_seqlens=cu_seqlens, lower_bound=lb)
        if keep:
            state.recurrent = S
        gate = self.g_b_proj(self.tp.copy(self.g_a_proj(x_BTD))) if self.lowrank_gate else self.g_proj(x_BTD)
        of = o.to(wide)
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.to(wide)
        of = of * torch.sigmoid(gate.to(wide).view(B, T, H, K))
        return self.o_proj(of.to(x_BTD.dtype).reshape(B, T, H * K))
