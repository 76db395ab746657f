"""Routed experts stored as batched weights [E, ...], run as one grouped GEMM over expert-sorted rows.

Legend: M routed rows (token-expert pairs, sorted by expert), L expert width (latent), I expert
intermediate size, E experts. offs_E holds the cumulative row count per expert (int32, on device), so
nothing syncs with the host on the grouped-GEMM path.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.layers import mark_batched_matrices
from .situ import glu_act

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands a contiguous gradient on (grouped_mm's backward requires it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def grouped_mm(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Row block e of x (rows offs[e-1]:offs[e]) times w[e]."""
    if x_MK.dtype in _GROUPED_MM_DTYPES and hasattr(torch, "_grouped_mm"):
        return _ContiguousGrad.apply(torch._grouped_mm(x_MK, w_EKN.to(x_MK.dtype), offs=offs_E.to(torch.int32)))
    ends = offs_E.tolist()  # fallback for other dtypes (e.g. float64 tests): a host sync is acceptable here
    starts = [0] + ends[:-1]
    return torch.cat([x_MK[s:e] @ w_EKN[i].to(x_MK.dtype) for i, (s, e) in enumerate(zip(starts, ends))])


class GroupedExperts(nn.Module):
    """E gated MLPs: y = w2 act(w1 z, w3 z), weights w1/w3 [E, I, L] and w2 [E, L, I] ([out, in] per expert)."""

    def __init__(self, num_experts: int, width: int, inter: int, act: str, beta_gate: float = 4.0,
                 beta_up: float = 25.0):
        super().__init__()
        self.num_experts, self.width, self.inter = num_experts, width, inter
        self.w1 = nn.Parameter(torch.empty(num_experts, inter, width))
        self.w3 = nn.Parameter(torch.empty(num_experts, inter, width))
        self.w2 = nn.Parameter(torch.empty(num_experts, width, inter))
        for w in (self.w1, self.w3, self.w2):  # Muon orthogonalises each expert's matrix on its own
            mark_batched_matrices(w)
        self.act, self.beta_gate, self.beta_up = act, beta_gate, beta_up
        # Quantisation-aware training hook (precision=mx_qat, set by megatron_k3.precision.qat): an object with
        # weight(w) and act(x) that fake-quantise along the last (reduction) dimension; None = off.
        self.qat = None

    def forward(self, z_ML: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        w1, w3, w2, q = self.w1, self.w3, self.w2, self.qat
        if q is not None:
            w1, w3, w2, z_ML = q.weight(w1), q.weight(w3), q.weight(w2), q.act(z_ML)
        gate = grouped_mm(z_ML, w1.transpose(1, 2), offs_E)
        up = grouped_mm(z_ML, w3.transpose(1, 2), offs_E)
        h = glu_act(gate, up, self.act, self.beta_gate, self.beta_up)
        if q is not None:
            h = q.act(h)
        return grouped_mm(h, w2.transpose(1, 2), offs_E)

    def forward_reference(self, z_ML: torch.Tensor, expert_M: torch.Tensor) -> torch.Tensor:
        """Plain per-row reference (any dtype, any order): row m goes through expert expert_M[m]."""
        out = z_ML.new_zeros(z_ML.shape[0], self.width)
        for e in range(self.num_experts):
            rows = (expert_M == e).nonzero(as_tuple=True)[0]
            if rows.numel():
                z = z_ML[rows]
                h = glu_act(z @ self.w1[e].T, z @ self.w3[e].T, self.act, self.beta_gate, self.beta_up)
                out[rows] = h @ self.w2[e].T
        return out
