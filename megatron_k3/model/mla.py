"""Gated Multi-head Latent Attention with NoPE (no positional encoding anywhere).

Legend: B batch, T query tokens, S key tokens, D hidden, H heads, N qk_nope dim, R the unrotated
head-shared key part, V value dim, L kv_lora_rank.
Prefill/training uses the expanded ("MHA") form; decode uses the absorbed form over the cached
576-wide latents [c_kv ; k_r], which with NoPE is exactly MQA with key dim L+R and value dim L.
QK-Clip support (MODEL.md 6.2): with `track_max_logit` on, a training forward records each head's max
logit; `rescale_qk_` shrinks a head's logits by gamma via its query/key weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cache import MLAState
from ..parallel.context import SequenceShard, attention_context_parallel, local_key_mask
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear, current_tp, mark_head_blocks
from .norm import RMSNorm, compute_dtype


def document_causal_mask(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """[T, T] bool: query t may attend key s iff s <= t and both lie in the same packed document."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=T)
    pos = torch.arange(T, device=cu_seqlens.device)
    return (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])


@torch.no_grad()
def max_logit_per_head(q_BHTK: torch.Tensor, k_BHSK: torch.Tensor, scale: float,
                       mask_TS: torch.Tensor | None = None, block: int = 256) -> torch.Tensor:
    """[H] fp32: the largest scale * q.k over batch, queries and the keys each query may see (causal when
    mask_TS is None). Query blocks of `block` rows bound the memory to [B, H, block, S]."""
    T, S = q_BHTK.shape[2], k_BHSK.shape[2]
    k = k_BHSK.float()
    out = torch.full((q_BHTK.shape[1],), float("-inf"), device=q_BHTK.device)
    for t0 in range(0, T, block):
        s = torch.einsum("bhtk,bhsk->bhts", q_BHTK[:, :, t0:t0 + block].float(), k) * scale
        rows = torch.arange(t0, min(t0 + block, T), device=s.device)
        allowed = (mask_TS[rows] if mask_TS is not None
                   else torch.arange(S, device=s.device)[None, :] <= rows[:, None])
        out = torch.maximum(out, s.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3)))
    return out


class GatedMLA(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.tp = tp = current_tp()
        D, Hf = cfg.hidden_size, cfg.mla_num_heads
        H = tp.divide(Hf, "model.mla_num_heads")  # this rank's heads
        self.layer_idx, self.H = layer_idx, H
        self.N, self.R, self.V, self.L = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        qk = self.N + self.R
        self.q_lora_rank = cfg.q_lora_rank
        if self.q_lora_rank:  # the compressions stay whole on every rank (column-parallel, gathered)
            self.q_a_proj = ColumnParallelLinear(D, self.q_lora_rank, gather_output=True, tp=tp)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.mla_latent_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, Hf * qk, tp=tp)
        else:
            self.q_proj = ColumnParallelLinear(D, Hf * qk, tp=tp)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(D, self.L + self.R, gather_output=True, tp=tp)
        self.kv_a_layernorm = RMSNorm(self.L, cfg.mla_latent_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.L, Hf * (self.N + self.V), tp=tp)
        self.gated = cfg.mla_output_gate
        if self.gated:
            self.g_proj = ColumnParallelLinear(D, Hf * self.V, tp=tp)
        self.o_proj = RowParallelLinear(Hf * self.V, D, tp=tp)
        self.scale = qk ** -0.5
        # Per-Head Muon: the per-head projections' head blocks (q_a / kv_a compressions stay whole)
        for proj in (self.q_b_proj if self.q_lora_rank else self.q_proj, self.kv_b_proj) + (
                (self.g_proj,) if self.gated else ()):
            mark_head_blocks(proj.weight, Hf, axis=0)
        mark_head_blocks(self.o_proj.weight, Hf, axis=1)
        self.track_max_logit = False  # QK-Clip: record max_logit_H [H] (running max until the optimizer reads it)
        self.max_logit_H = None

    def _queries(self, x):
        B, T, _ = x.shape
        q = (self.q_b_proj(self.tp.copy(self.q_a_layernorm(self.q_a_proj(x)))) if self.q_lora_rank
             else self.q_proj(x))
        return q.view(B, T, self.H, self.N + self.R)

    def _latents(self, x):
        c, k_r = self.kv_a_proj_with_mqa(x).split([self.L, self.R], dim=-1)
        return self.kv_a_layernorm(c), k_r

    def _output(self, o_BTHV, x):
        wide = compute_dtype(x)
        B, T = x.shape[:2]
        o = o_BTHV.reshape(B, T, self.H * self.V)
        if self.gated:
            o = (o.to(wide) * torch.sigmoid(self.g_proj(x).to(wide))).to(x.dtype)
        return self.o_proj(o)

    def forward(self, x_BTD: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                state: MLAState | None = None, context: SequenceShard | None = None) -> torch.Tensor:
        """context: this rank's share of a context-parallel sequence: the compressed latent [c ; k_r] (L + R
        per token) is all-gathered over the CP group, keys and values are expanded from it locally, and the
        local queries attend to the keys their positions allow (parallel/context.py)."""
        x_BTD = self.tp.enter(x_BTD)  # whole sequence on every TP rank; this rank's heads below
        if state is not None and state.length > 0:
            return self.forward_absorbed(x_BTD, state)
        if context is not None and state is not None:
            raise ValueError("context parallelism is for training and prefill without a decode cache")
        B, T, _ = x_BTD.shape
        q = self._queries(x_BTD)
        c, k_r = self._latents(x_BTD)
        if state is not None:
            state.latent, state.k_rope = c.detach(), k_r.detach()
        if context is not None:  # the latent of the whole sequence, not its expanded keys and values
            c, k_r = context.gather(torch.cat([c, k_r], dim=-1)).split([self.L, self.R], dim=-1)
        S = c.shape[1]  # key tokens: T, or the whole sequence under context parallelism
        kv = self.kv_b_proj(self.tp.copy(c)).view(B, S, self.H, self.N + self.V)
        k_r = self.tp.copy(k_r)  # complete on every rank; used by this rank's heads
        k_nope, v = kv.split([self.N, self.V], dim=-1)
        k = torch.cat([k_nope, k_r[:, :, None, :].expand(B, S, self.H, self.R)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, .]
        if context is not None:
            o = attention_context_parallel(q, k, v, context, self.scale)
            if self.track_max_logit and self.training:
                m = max_logit_per_head(q.detach(), k.detach(), self.scale, local_key_mask(context, q.device))
                torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=context.cp.group)
                self.max_logit_H = m if self.max_logit_H is None else torch.maximum(self.max_logit_H, m)
            return self._output(o.transpose(1, 2), x_BTD)
        mask = None if cu_seqlens is None else document_causal_mask(cu_seqlens, T)
        if mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        if self.track_max_logit and self.training:
            m = max_logit_per_head(q, k, self.scale, mask)
            self.max_logit_H = m if self.max_logit_H is None else torch.maximum(self.max_logit_H, m)
        return self._output(o.transpose(1, 2), x_BTD)

    @torch.no_grad()
    def rescale_qk_(self, gamma_H: torch.Tensor) -> list:
        """QK-Clip: scale head h's logits by gamma_H[h] (MODEL.md 6.2): its q_nope and k_nope weight rows by
        sqrt(gamma), its unrotated q part by gamma; the head-shared k_r is left alone. Returns the changed
        parameters."""
        wq = (self.q_b_proj if self.q_lora_rank else self.q_proj).weight
        g = gamma_H.to(wq.dtype)[:, None, None]
        q_HQI = wq.view(self.H, self.N + self.R, wq.shape[-1])
        q_HQI[:, : self.N] *= g.sqrt()
        q_HQI[:, self.N:] *= g
        wkv = self.kv_b_proj.weight
        wkv.view(self.H, self.N + self.V, self.L)[:, : self.N] *= g.sqrt().to(wkv.dtype)
        return [wq, wkv]

    def forward_absorbed(self, x_BTD: torch.Tensor, state: MLAState) -> torch.Tensor:
        """Decode against the latent cache: q~_h = W_UK,h^T q_h^nope; scores over [c ; k_r]; the context
        stays in latent space and W_UV,h lifts it per head."""
        B, T, _ = x_BTD.shape
        wide = compute_dtype(x_BTD)
        q = self._queries(x_BTD)
        q_nope, q_r = q.split([self.N, self.R], dim=-1)
        c_new, kr_new = self._latents(x_BTD)
        P = state.length
        state.latent = torch.cat([state.latent, c_new.detach()], dim=1)
        state.k_rope = torch.cat([state.k_rope, kr_new.detach()], dim=1)
        w = self.kv_b_proj.weight.view(self.H, self.N + self.V, self.L)
        w_uk, w_uv = w[:, : self.N], w[:, self.N:]  # [H, N, L], [H, V, L]
        q_lat = torch.einsum("bthn,hnl->bthl", q_nope, w_uk)
        scores = (torch.einsum("bthl,bsl->bhts", q_lat, state.latent)
                  + torch.einsum("bthr,bsr->bhts", q_r, state.k_rope)) * self.scale
        S = P + T
        allowed = torch.arange(S, device=x_BTD.device)[None, :] <= (P + torch.arange(T, device=x_BTD.device))[:, None]
        scores = scores.to(wide).masked_fill(~allowed, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(x_BTD.dtype)
        ctx = torch.einsum("bhts,bsl->bthl", p, state.latent)
        o = torch.einsum("bthl,hvl->bthv", ctx, w_uv)
        return self._output(o, x_BTD)
