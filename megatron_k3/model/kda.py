"""Kimi Delta Attention layer: projections, short convolutions, gates, the delta rule, gated output norm.

Legend: B batch, T tokens, D hidden, H heads, K head dim (= V), R decay rank.
q, k = L2Norm(SiLU(Conv4(W x))) per head; v = SiLU(Conv4(W_v x)); decay logit z = W_fb W_fa x;
log-decay g = lb * sigmoid(e^A (z + dt_bias)) (K3) or -e^A softplus(z + dt_bias) (Kimi Linear);
beta = sigmoid(W_b x); out = o_proj( RMSNorm_head(o) * sigmoid(gate(x)) ).
The two steps that mix tokens along the sequence (the short convolution and the delta rule) run through
`self.kernels`, so that a layout which splits the sequence can substitute kernels that carry state across it.
Packed documents: `cu_seqlens` (N+1 offsets of one row, read on the host; prefill with a decode cache) or
`seq_idx` [B, T] (the document index of each token; static shapes, no host read; training and plain forwards).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..annotations import annotate
from ..ops.init import Init, constant, uniform
from ..ops.kda import chunk_kda, recurrent_kda
from ..ops.numerics import compute_dtype
from ..ops.short_conv import causal_conv1d
from .cache import KDAState
from .layers import Linear
from .norm import l2norm


class KDAKernels:
    """The sequence-mixing steps of a KDA layer over the whole sequence on one device. `chunk_fn` is the chunked
    delta rule (`ops.kda.chunk_kda`'s signature) every path runs; a wrapper may stand in for it (sequence tiling)."""

    chunk_fn = staticmethod(chunk_kda)

    def conv(self, x_BTC: torch.Tensor, weight_CW: torch.Tensor, cache: torch.Tensor | None,
             cu_seqlens: torch.Tensor | None, keep: bool, seq_idx: torch.Tensor | None = None):
        """SiLU(causal depthwise conv) -> (y [B, T, C], the new decode cache when `keep`). Documents as cu_seqlens
        or seq_idx [B, T] (at most one)."""
        return causal_conv1d(x_BTC, weight_CW, cache, cu_seqlens=cu_seqlens, activation="silu", output_cache=keep,
                             seq_idx=seq_idx)

    def delta_rule(self, q, k, v, g, beta, initial_state, keep: bool, cu_seqlens, chunk_size: int, lower_bound,
                   seq_idx=None):
        """The gated delta rule -> (o [B, T, H, V], the final state when `keep`). Documents as cu_seqlens or
        seq_idx [B, T] (at most one; seq_idx takes no state)."""
        if keep and initial_state is not None and q.shape[1] <= 4:  # decode: the plain recurrence is the cheapest
            return recurrent_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)
        return self.chunk_fn(q, k, v, g, beta, initial_state=initial_state, output_final_state=keep,
                             chunk_size=chunk_size, cu_seqlens=cu_seqlens, seq_idx=seq_idx, lower_bound=lower_bound)


def _dt_bias_from_log_dt(log_dt: torch.Tensor) -> torch.Tensor:
    """softplus^-1(dt) for dt = exp(log_dt) (at least 1e-4): the time-step bias of fla's KDA init."""
    dt = log_dt.exp().clamp_min(1e-4)
    return dt + torch.log(-torch.expm1(-dt))


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        D, H, K, W = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
        self.layer_idx, self.K, self.W = layer_idx, K, W
        self.q_proj = Linear(D, H * K, bias=False)
        self.k_proj = Linear(D, H * K, bias=False)
        self.v_proj = Linear(D, H * K, bias=False)
        # depthwise causal conv filters, nn.Conv1d layout [C, 1, W], kept in fp32
        self.q_conv1d = nn.Parameter(torch.empty(H * K, 1, W))
        self.k_conv1d = nn.Parameter(torch.empty(H * K, 1, W))
        self.v_conv1d = nn.Parameter(torch.empty(H * K, 1, W))
        R = cfg.decay_rank
        self.f_a_proj = Linear(D, R, bias=False)  # the low-rank decay bottleneck
        self.f_b_proj = Linear(R, H * K, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H * K))
        self.b_proj = Linear(D, H, bias=False)
        self.gate_kind = cfg.kda_gate
        self.lower_bound = cfg.kda_gate_lower_bound
        self.lowrank_gate = cfg.kda_output_gate == "lowrank"
        if self.lowrank_gate:
            self.g_a_proj = Linear(D, K, bias=False)
            self.g_b_proj = Linear(K, H * K, bias=cfg.kda_output_gate_bias)
        else:
            self.g_proj = Linear(D, H * K, bias=False)
        self.o_norm = nn.Parameter(torch.ones(K))  # RMSNorm weight shared by all heads
        self.o_proj = Linear(H * K, D, bias=False)
        # Per-Head Muon: q/k/v/output-gate rows and o_proj columns are head blocks (the low-rank f/g stay whole)
        for proj in (self.q_proj, self.k_proj, self.v_proj) + (() if self.lowrank_gate else (self.g_proj,)):
            annotate(proj.weight, blocks=H, block_axis=0, block_kind="heads")
        annotate(self.o_proj.weight, blocks=H, block_axis=1, block_kind="heads")
        self.eps = cfg.rms_norm_eps
        self.chunk_size = cfg.kda_chunk_size
        self.a_log_init = cfg.kda_a_log_init
        self.kernels = KDAKernels()

    @property
    def H(self) -> int:
        """The heads this module computes (all of them; a tensor-parallel rank's share once parallelised)."""
        return self.A_log.shape[0]

    def init_of(self, name: str) -> Init | None:
        """The initial distribution of its own parameter `name`: A_log = 0 (K3) or log U(1, 16) (fla); dt_bias =
        inverse-softplus of dt ~ logU(1e-3, 1e-1); conv filters as nn.Conv1d (uniform +-1/sqrt(W)); o_norm ones.
        None for the projections (the model's normal init)."""
        if name == "A_log":
            return constant(0.0) if self.a_log_init == "zero" else uniform(1, 16, then=torch.log)
        if name == "dt_bias":
            return uniform(math.log(1e-3), math.log(1e-1), then=_dt_bias_from_log_dt)
        if name.endswith("conv1d"):
            bound = 1.0 / math.sqrt(self.W)
            return uniform(-bound, bound)
        if name == "o_norm":
            return constant(1.0)
        return None

    def log_decay(self, z_BTC: torch.Tensor) -> torch.Tensor:
        """Per-step, per-channel log-decay g [B, T, H, K] in fp32 from the decay projection z = W_fb W_fa x."""
        wide = compute_dtype(z_BTC)
        z = z_BTC.to(wide) + self.dt_bias.to(wide)
        z = z.reshape(*z_BTC.shape[:2], -1, self.K)  # (view: aot_eager's backward of softplus trips on it)
        a = self.A_log.to(wide).exp()[:, None]
        if self.gate_kind == "lowerbound":
            return self.lower_bound * torch.sigmoid(a * z)
        return -a * F.softplus(z)

    def forward(self, x_BTD: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                state: KDAState | None = None, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]. Packed documents as cu_seqlens (B = 1) or seq_idx [B, T] (no state), or
        neither; state: the decode cache, continued and updated in place."""
        B, T, _ = x_BTD.shape
        gate = self.g_b_proj(self.g_a_proj(x_BTD)) if self.lowrank_gate else self.g_proj(x_BTD)
        o = self.core(self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD), self.f_b_proj(self.f_a_proj(x_BTD)),
                      self.b_proj(x_BTD), gate, cu_seqlens, state, seq_idx)
        return self.o_proj(o.to(x_BTD.dtype).reshape(B, T, -1))

    def core(self, q_BTC, k_BTC, v_BTC, z_BTC, b_BTH, gate_BTC, cu_seqlens=None, state: KDAState | None = None,
             seq_idx=None) -> torch.Tensor:
        """Everything between the input projections and o_proj (C = H K): short convolutions, L2 norms, decay and
        beta, the delta rule, the gated output norm -> [B, T, H, K] (fp32 at least). Its inputs are the
        projections' outputs; the elementwise work and the chunked kernel inside are what selective recomputation
        (`core_attn`) rebuilds in the backward."""
        B, T, _ = q_BTC.shape
        K = self.K
        wide = compute_dtype(q_BTC)
        keep = state is not None
        convs = []
        for y, w, name in ((q_BTC, self.q_conv1d, "conv_q"), (k_BTC, self.k_conv1d, "conv_k"),
                           (v_BTC, self.v_conv1d, "conv_v")):
            y, c = self.kernels.conv(y, w.squeeze(1), getattr(state, name) if keep else None, cu_seqlens, keep,
                                     seq_idx=seq_idx)
            if keep:
                setattr(state, name, c)
            convs.append(y.view(B, T, -1, K))
        q, k, v = convs
        q, k = l2norm(q, 1e-6), l2norm(k, 1e-6)
        g = self.log_decay(z_BTC)
        beta = torch.sigmoid(b_BTH.to(wide))
        lb = self.lower_bound if self.gate_kind == "lowerbound" else None
        o, S = self.kernels.delta_rule(q, k, v, g, beta, state.recurrent if keep else None, keep, cu_seqlens,
                                       self.chunk_size, lb, seq_idx=seq_idx)
        if keep:
            state.recurrent = S
        of = o.to(wide)
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.to(wide)
        return of * torch.sigmoid(gate_BTC.to(wide).view(B, T, -1, K))
