"""Attention residuals: a softmax over depth.

Legend: N sources (completed blocks + the running partial), D hidden, Q pseudo-queries.
Given sources v_0..v_{N-1} and a pseudo-query w with key-norm weight gamma:
    l_i = sum_c RMS(v_i)[c] * gamma[c] * w[c];   alpha = softmax_i(l);   h = sum_i alpha_i v_i
Keys are RMS-normalised sources (scoring only); values are the raw sources. All of it in fp32 because
the mix logits sit close together (margins ~1e-2) and the result is sensitive to rounding.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .numerics import atleast_fp32 as _f32  # fp64 stays fp64 so that reference tests can run the model in fp64


def _inv_rms(v: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)


def attn_res(sources: Sequence[torch.Tensor], query_D: torch.Tensor, norm_weight_D: torch.Tensor,
             eps: float = 1e-6, return_weights: bool = False):
    """One-shot depth mix of `sources` (each [..., D]); returns [..., D] in the sources' dtype, and with
    `return_weights` also the depth weights alpha [N, ...] (fp32, differentiable)."""
    dtype = sources[0].dtype
    V = torch.stack([_f32(s) for s in sources])  # [N, ..., D]
    qk = _f32(query_D) * _f32(norm_weight_D)
    logits = (V * _inv_rms(V, eps) * qk).sum(-1)  # [N, ...]
    alpha = torch.softmax(logits, dim=0)
    h = (alpha.unsqueeze(-1) * V).sum(0).to(dtype)
    return (h, alpha) if return_weights else h


def attn_res_block_stats(blocks: Sequence[torch.Tensor], queries_QD: torch.Tensor, norm_weights_QD: torch.Tensor,
                         eps: float = 1e-6):
    """Phase 1 of the two-phase form: online-softmax statistics of Q pseudo-queries over the completed
    blocks, computed once per block. Returns (m [Q, ...], Z [Q, ...], num [Q, ..., D]) in fp32."""
    V = torch.stack([_f32(b) for b in blocks])  # [N, ..., D]
    K = V * _inv_rms(V, eps)
    qk = _f32(queries_QD) * _f32(norm_weights_QD)  # [Q, D]
    shape = (qk.shape[0],) + (1,) * (K.dim() - 1) + (qk.shape[-1],)
    logits = (K.unsqueeze(0) * qk.view(shape)).sum(-1)  # [Q, N, ...]
    m = logits.amax(dim=1)
    e = torch.exp(logits - m.unsqueeze(1))
    Z = e.sum(1)
    num = (e.unsqueeze(-1) * V.unsqueeze(0)).sum(1)
    return m, Z, num


def attn_res_merge(stats, q_index: int, partial: torch.Tensor, query_D: torch.Tensor, norm_weight_D: torch.Tensor,
                   eps: float = 1e-6) -> torch.Tensor:
    """Phase 2: score the running partial sum with pseudo-query `q_index` and merge it into that query's
    statistics; equals `attn_res(blocks + [partial], ...)` up to rounding."""
    m, Z, num = (t[q_index] for t in stats)
    p = _f32(partial)
    r = (p * _inv_rms(p, eps) * (_f32(query_D) * _f32(norm_weight_D))).sum(-1)
    M = torch.maximum(m, r)
    a, b = torch.exp(m - M), torch.exp(r - M)
    return ((a.unsqueeze(-1) * num + b.unsqueeze(-1) * p) / (a * Z + b).unsqueeze(-1)).to(partial.dtype)
