"""Scaled dot-product attention with a value head dim other than the query/key one (Gated MLA: 128 vs 192).

torch's CPU flash kernel needs one head dim for q, k and v; with another value dim F.scaled_dot_product_attention
falls back to its math path, which keeps the [B, H, T, S] fp32 probabilities (and makes more of the same size in
its backward): at 2048 queries over 16384 keys and 12 heads, 1.6 GB per tensor. `attention` zero-pads the values
to the key dim on the CPU, so the flash kernel runs (it keeps the log-sum-exp, not the probabilities), and cuts the
output back: the padded columns of the output are zeros and take no gradient, so the result is the attention of
q, k, v (up to the flash kernel's fp32 rounding, against the math path's). Elsewhere (CUDA kernels take the two
dims) it is F.scaled_dot_product_attention as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["attention"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """F.scaled_dot_product_attention(q [.., T, K], k [.., S, K], v [.., S, V]) -> [.., T, V] (module docstring)."""
    V, pad = v.shape[-1], q.shape[-1] - v.shape[-1]
    if q.device.type == "cpu" and pad > 0:
        v = F.pad(v, (0, pad))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    return o[..., :V]
