"""Gated Multi-head Latent Attention with NoPE (no positional encoding anywhere).

Legend: B batch, T query tokens, S key tokens, D hidden, H heads, N qk_nope dim, R the unrotated
head-shared key part, V value dim, L kv_lora_rank.
Prefill/training uses the expanded ("MHA") form; decode uses the absorbed form over the cached
576-wide latents [c_kv ; k_r], which with NoPE is exactly MQA with key dim L+R and value dim L.
The steps that see the whole sequence (which positions the keys come from, the causal attention itself, and
QK-Clip's max-logit statistic) run through `self.kernels`, so that a layout which splits the sequence can
substitute kernels that gather it.
Packed documents: `cu_seqlens` (N+1 offsets of one row) or `seq_idx` [B, T] (the document index of each token,
non-decreasing along T; static shapes, no host read): a query sees only the keys of its own document.
QK-Clip support (MODEL.md 6.2): with `track_max_logit` on, a training forward records each head's max
logit; `rescale_qk_` shrinks a head's logits by gamma via its query/key weights.
"""

from __future__ import annotations

import torch
from torch import nn

from ..annotations import annotate
from ..ops.attention import attention
from ..ops.kda import seq_idx_from_cu_seqlens
from ..ops.numerics import compute_dtype
from .cache import MLAState
from .layers import Linear, recomputing
from .norm import RMSNorm


def document_causal_mask(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """[T, T] bool: query t may attend key s iff s <= t and both lie in the same packed document."""
    return seq_idx_causal_mask(seq_idx_from_cu_seqlens(cu_seqlens, T))[0]


def seq_idx_causal_mask(seq_idx_BT: torch.Tensor) -> torch.Tensor:
    """[B, T, T] bool: query t of row b may attend key s iff s <= t and seq_idx[b, s] == seq_idx[b, t] (the
    document_causal_mask of each row, from its per-token document index; static shapes)."""
    T = seq_idx_BT.shape[1]
    pos = torch.arange(T, device=seq_idx_BT.device)
    return (seq_idx_BT[:, :, None] == seq_idx_BT[:, None, :]) & (pos[None, :] <= pos[:, None])


@torch.no_grad()
def max_logit_per_head(q_BHTK: torch.Tensor, k_BHSK: torch.Tensor, scale: float,
                       mask_TS: torch.Tensor | None = None, block: int = 256) -> torch.Tensor:
    """[H] fp32: the largest scale * q.k over batch, queries and the keys each query may see (causal when
    mask_TS is None; mask_TS is [T, S] for every row or [B, T, S] per row). Query blocks of `block` rows bound the
    memory to [B, H, block, S]."""
    T, S = q_BHTK.shape[2], k_BHSK.shape[2]
    k = k_BHSK.float()
    out = torch.full((q_BHTK.shape[1],), float("-inf"), device=q_BHTK.device)
    for t0 in range(0, T, block):
        s = torch.einsum("bhtk,bhsk->bhts", q_BHTK[:, :, t0:t0 + block].float(), k) * scale
        rows = torch.arange(t0, min(t0 + block, T), device=s.device)
        allowed = (mask_TS[..., rows, :] if mask_TS is not None
                   else torch.arange(S, device=s.device)[None, :] <= rows[:, None])
        if allowed.dim() == 3:  # per row: [B, block, S] -> [B, 1, block, S]
            allowed = allowed[:, None]
        out = torch.maximum(out, s.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3)))
    return out


class AttentionKernels:
    """The sequence-wide steps of a Gated MLA layer over the whole sequence on one device."""

    def key_positions(self, c_BTL: torch.Tensor, k_r_BTR: torch.Tensor):
        """The normalised latent and head-shared key part of every position the local queries attend to: here the
        queries' own."""
        return c_BTL, k_r_BTR

    @staticmethod
    def _mask(cu_seqlens, seq_idx, T):
        """The document-causal mask ([T, T] from cu_seqlens, [B, T, T] from seq_idx), or None (plain causal)."""
        if seq_idx is not None:
            if cu_seqlens is not None:
                raise ValueError("attention takes the documents as cu_seqlens or as seq_idx, not both")
            return seq_idx_causal_mask(seq_idx)
        return None if cu_seqlens is None else document_causal_mask(cu_seqlens, T)

    def attend(self, q_BHTK, k_BHSK, v_BHSV, cu_seqlens, scale: float, seq_idx=None) -> torch.Tensor:
        """Causal attention (document-local with packed rows: cu_seqlens, or seq_idx [B, T]) -> [B, H, T, V]."""
        mask = self._mask(cu_seqlens, seq_idx, q_BHTK.shape[2])
        if mask is None:
            return attention(q_BHTK, k_BHSK, v_BHSV, is_causal=True, scale=scale)
        if mask.dim() == 3:  # per row, broadcast over heads
            mask = mask[:, None]
        return attention(q_BHTK, k_BHSK, v_BHSV, attn_mask=mask, scale=scale)

    def max_logit(self, q_BHTK, k_BHSK, cu_seqlens, scale: float, seq_idx=None) -> torch.Tensor:
        """[H]: the largest logit of each head over the keys its queries may see."""
        return max_logit_per_head(q_BHTK, k_BHSK, scale, self._mask(cu_seqlens, seq_idx, q_BHTK.shape[2]))


class HeadBroadcast(nn.Module):
    """The head-shared key part [B, S, R], broadcast to every head: [B, S, H, R]."""

    def forward(self, k_r_BSR: torch.Tensor, heads: int) -> torch.Tensor:
        B, S, R = k_r_BSR.shape
        return k_r_BSR[:, :, None, :].expand(B, S, heads, R)


class GatedMLA(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        D, H = cfg.hidden_size, cfg.mla_num_heads
        self.layer_idx = layer_idx
        self.N, self.R, self.V, self.L = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        qk = self.N + self.R
        self.q_lora_rank = cfg.q_lora_rank
        if self.q_lora_rank:
            self.q_a_proj = Linear(D, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.mla_latent_norm_eps)
            self.q_b_proj = Linear(self.q_lora_rank, H * qk, bias=False)
        else:
            self.q_proj = Linear(D, H * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(D, self.L + self.R, bias=False)
        self.kv_a_layernorm = RMSNorm(self.L, cfg.mla_latent_norm_eps)
        self.kv_b_proj = Linear(self.L, H * (self.N + self.V), bias=False)
        self.gated = cfg.mla_output_gate
        if self.gated:
            self.g_proj = Linear(D, H * self.V, bias=False)
        self.o_proj = Linear(H * self.V, D, bias=False)
        self.k_rope_broadcast = HeadBroadcast()
        self.scale = qk ** -0.5
        # Per-Head Muon: the per-head projections' head blocks (q_a / kv_a compressions stay whole)
        for proj in (self.q_b_proj if self.q_lora_rank else self.q_proj, self.kv_b_proj) + (
                (self.g_proj,) if self.gated else ()):
            annotate(proj.weight, blocks=H, block_axis=0, block_kind="heads")
        annotate(self.o_proj.weight, blocks=H, block_axis=1, block_kind="heads")
        self.kernels = AttentionKernels()
        self.track_max_logit = False  # QK-Clip: record max_logit_H [H] (running max until the optimizer reads it)
        self.max_logit_H = None

    @property
    def H(self) -> int:
        """The heads this module computes (all of them; a tensor-parallel rank's share once parallelised)."""
        return self.kv_b_proj.weight.shape[0] // (self.N + self.V)

    def _queries(self, x):
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        return q.view(B, T, -1, self.N + self.R)

    def _latents(self, x):
        c, k_r = self.kv_a_proj_with_mqa(x).split([self.L, self.R], dim=-1)
        return self.kv_a_layernorm(c), k_r

    def _output(self, o_BTHV, x):
        wide = compute_dtype(x)
        B, T = x.shape[:2]
        o = o_BTHV.reshape(B, T, -1)
        if self.gated:
            o = (o.to(wide) * torch.sigmoid(self.g_proj(x).to(wide))).to(x.dtype)
        return self.o_proj(o)

    def forward(self, x_BTD: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                state: MLAState | None = None, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]. Packed documents as cu_seqlens (B = 1) or seq_idx [B, T], or neither; state:
        the latent cache (a non-empty one is continued by the absorbed decode form, one sequence per row)."""
        if state is not None and state.length > 0:
            return self.forward_absorbed(x_BTD, state)
        B, T, _ = x_BTD.shape
        q = self._queries(x_BTD)
        c, k_r = self._latents(x_BTD)
        if state is not None:
            state.latent, state.k_rope = c.detach(), k_r.detach()
        c, k_r = self.kernels.key_positions(c, k_r)
        S = c.shape[1]  # key tokens
        kv = self.kv_b_proj(c).view(B, S, -1, self.N + self.V)
        k_nope, v = kv.split([self.N, self.V], dim=-1)
        k = torch.cat([k_nope, self.k_rope_broadcast(k_r, kv.shape[2])], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, .]
        o = self.kernels.attend(q, k, v, cu_seqlens, self.scale, seq_idx=seq_idx)
        if self.track_max_logit and self.training and not recomputing():
            m = self.kernels.max_logit(q, k, cu_seqlens, self.scale, seq_idx=seq_idx)
            self.max_logit_H = m if self.max_logit_H is None else torch.maximum(self.max_logit_H, m)
        return self._output(o.transpose(1, 2), x_BTD)

    @torch.no_grad()
    def rescale_qk_(self, gamma_H: torch.Tensor) -> list:
        """QK-Clip: scale head h's logits by gamma_H[h] (MODEL.md 6.2): its q_nope and k_nope weight rows by
        sqrt(gamma), its unrotated q part by gamma; the head-shared k_r is left alone. Returns the changed
        parameters."""
        wq = (self.q_b_proj if self.q_lora_rank else self.q_proj).weight
        g = gamma_H.to(wq.dtype)[:, None, None]
        q_HQI = wq.view(-1, self.N + self.R, wq.shape[-1])
        q_HQI[:, : self.N] *= g.sqrt()
        q_HQI[:, self.N:] *= g
        wkv = self.kv_b_proj.weight
        wkv.view(-1, self.N + self.V, self.L)[:, : self.N] *= g.sqrt().to(wkv.dtype)
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
        w = self.kv_b_proj.weight.view(-1, self.N + self.V, self.L)
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
