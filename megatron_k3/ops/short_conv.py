"""Causal depthwise short convolution with a decode cache and packed-document boundaries.

Legend: B batch, T tokens, C channels, W kernel width.
y_t[c] = act( sum_{s=0..W-1} w[c, W-1-s] * x_{t-s}[c] ), where x_{t-s} is zero before the start of t's
document (or comes from the decode cache for a continued sequence).
Documents of a packed row are given either as `cu_seqlens` (N+1 offsets, B = 1) or as `seq_idx` [B, T] (the
document index of each token, non-decreasing along T): tap s of token t is used iff t - s >= 0 and
seq_idx[t - s] == seq_idx[t]; static shapes, no host read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kda import seq_idx_from_cu_seqlens


def causal_conv1d(x_BTC: torch.Tensor, weight_CW: torch.Tensor, cache_BWC: torch.Tensor | None = None,
                  cu_seqlens: torch.Tensor | None = None, activation: str | None = "silu",
                  output_cache: bool = False, seq_idx: torch.Tensor | None = None):
    """Depthwise causal conv over the time axis.

    x_BTC: input; weight_CW: one filter per channel (nn.Conv1d's [C, 1, W] weight squeezed);
    cache_BWC: the previous W-1 inputs of a continued sequence (decode), or None for zeros;
    cu_seqlens: document offsets of a packed row (B must be 1): the filter never reaches across a boundary.
    seq_idx: [B, T] document index of each token (any B), the same boundaries without reading the host; exclusive
    with cu_seqlens and with a cache.
    Returns (y_BTC, new_cache_BWC or None); the new cache holds the last W-1 inputs.
    """
    B, T, C = x_BTC.shape
    W = weight_CW.shape[-1]
    if weight_CW.shape != (C, W):
        raise ValueError(f"causal_conv1d: weight must be [C={C}, W], got {tuple(weight_CW.shape)}")
    if cu_seqlens is not None and (B != 1 or cache_BWC is not None):
        raise ValueError("causal_conv1d: cu_seqlens needs batch size 1 and no cache")
    if seq_idx is not None:
        if cu_seqlens is not None or cache_BWC is not None:
            raise ValueError("causal_conv1d: seq_idx takes neither cu_seqlens nor a cache")
        if tuple(seq_idx.shape) != (B, T):
            raise ValueError(f"causal_conv1d: seq_idx must be [B, T] = {(B, T)}, got {tuple(seq_idx.shape)}")
    w = weight_CW.to(x_BTC.dtype)
    if cache_BWC is None:
        cache_BWC = x_BTC.new_zeros(B, W - 1, C)
    elif cache_BWC.shape != (B, W - 1, C):
        raise ValueError(f"causal_conv1d: cache must be [B, W-1={W - 1}, C], got {tuple(cache_BWC.shape)}")
    xp = torch.cat([cache_BWC.to(x_BTC.dtype), x_BTC], dim=1)  # [B, W-1+T, C]
    if cu_seqlens is not None:  # one masking mechanism: the offsets as the per-token document index
        seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, T, x_BTC.device)
    # the document of every position of xp (the W-1 leading slots read zeros, whatever their mark)
    doc = F.pad(seq_idx.to(x_BTC.device), (W - 1, 0), value=-1) if seq_idx is not None else None
    y = x_BTC * w[:, W - 1]
    for s in range(1, W):  # tap s looks s steps back
        tap = xp[:, W - 1 - s: W - 1 - s + T]
        if doc is not None:
            tap = tap * (doc[:, W - 1 - s: W - 1 - s + T] == doc[:, W - 1:]).to(tap.dtype)[..., None]
        y = y + tap * w[:, W - 1 - s]
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"causal_conv1d: unknown activation {activation!r}")
    new_cache = xp[:, -(W - 1):].detach() if (output_cache and W > 1) else None
    return y, new_cache


def causal_conv1d_reference(x_BTC, weight_CW, activation="silu"):
    """Plain reference: nn.functional.conv1d with left padding, one sequence per row."""
    C, W = weight_CW.shape
    y = F.conv1d(F.pad(x_BTC.transpose(1, 2), (W - 1, 0)), weight_CW[:, None, :].to(x_BTC.dtype), groups=C)
    y = y.transpose(1, 2)
    return F.silu(y) if activation == "silu" else y
