"""Routed experts stored as batched weights [E, ...], run as one grouped GEMM over expert-sorted rows.

Legend: M routed rows (token-expert pairs, sorted by expert), L expert width (latent), I expert
intermediate size, E experts, C rows per expert (static buffers). offs_E holds the cumulative row count per
expert (int32, on device), so nothing syncs with the host on the grouped-GEMM path.

Under expert parallelism a rank holds the block of experts [offset, offset + E/ep) of the E global ones; the
weights keep the global layout's names and [E, ...] order (`parallel.layers.shard_tensor` / `full_shape`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.layers import EPContext, mark_batched_matrices, mark_expert_sharded
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
                 beta_up: float = 25.0, ep: EPContext | None = None):
        super().__init__()
        ep = ep or EPContext()
        if num_experts % ep.size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {ep.size}")
        self.num_experts, self.width, self.inter = num_experts, width, inter  # num_experts: global
        self.num_local = num_experts // ep.size
        self.expert_offset = ep.rank * self.num_local  # global id of local expert 0
        El = self.num_local
        self.w1 = mark_expert_sharded(nn.Parameter(torch.empty(El, inter, width)), ep)
        self.w3 = mark_expert_sharded(nn.Parameter(torch.empty(El, inter, width)), ep)
        self.w2 = mark_expert_sharded(nn.Parameter(torch.empty(El, width, inter)), ep)
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

    def forward_batched(self, x_ECL: torch.Tensor) -> torch.Tensor:
        """Static shapes: C rows for each local expert, [El, C, L] -> [El, C, L], as batched GEMMs."""
        w1, w3, w2, q = self.w1, self.w3, self.w2, self.qat
        if q is not None:
            w1, w3, w2, x_ECL = q.weight(w1), q.weight(w3), q.weight(w2), q.act(x_ECL)
        dt = x_ECL.dtype
        gate = torch.bmm(x_ECL, w1.to(dt).transpose(1, 2))
        up = torch.bmm(x_ECL, w3.to(dt).transpose(1, 2))
        h = glu_act(gate, up, self.act, self.beta_gate, self.beta_up)
        if q is not None:
            h = q.act(h)
        return torch.bmm(h, w2.to(h.dtype).transpose(1, 2))

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
