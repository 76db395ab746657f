"""Routed experts stored as batched weights [E, ...], run as one grouped GEMM over expert-sorted rows.

Legend: M routed rows (token-expert pairs, sorted by expert), L expert width (latent), I expert
intermediate size, E experts, C rows per expert (static buffers). offs_E holds the cumulative row count per
expert (int32, on device), so nothing syncs with the host on the grouped-GEMM path.

Forward and backward run as two autograd Functions: `_GateUpGLU` (w1 and w3 as one GEMM against their per-step
concatenation, then the GLU of situ.py, derivative by hand) and, where the dispatcher can combine right after
the experts, `_DownCombine` (down projection, fp32 routing weight and the weighted index_add into the token
rows). The parameters keep their separate w1 / w3 / w2 layout.

Under expert parallelism a rank holds the block of experts [offset, offset + E/ep) of the E global ones; the
weights keep the global layout's names and [E, ...] order (`parallel.layers.shard_tensor` / `full_shape`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.layers import EPContext, mark_batched_matrices, mark_expert_sharded
from .situ import glu_backward, glu_forward, glu_reference

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands a contiguous gradient on (grouped_mm's backward requires it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _spans(offs_E: torch.Tensor):
    ends = offs_E.tolist()  # fallback for dtypes _grouped_mm lacks (e.g. float64 tests): a host sync is fine there
    return list(zip([0] + ends[:-1], ends))


def _native(dtype) -> bool:
    return dtype in _GROUPED_MM_DTYPES and hasattr(torch, "_grouped_mm")


def _rows_mm(x: torch.Tensor, w: torch.Tensor, offs_E: torch.Tensor | None) -> torch.Tensor:
    """The GEMMs the Functions below run (autograd records them where it is on: `grouped_mm`). offs_E given: row block e of x [M, K] times w[e] [K, N] -> [M, N] (grouped GEMM);
    None: x [E, C, K] times w [E, K, N] (batched GEMM)."""
    if offs_E is None:
        return torch.bmm(x, w)
    if _native(x.dtype):
        return torch._grouped_mm(x, w, offs=offs_E.to(torch.int32))
    return torch.cat([x[s:e] @ w[i] for i, (s, e) in enumerate(_spans(offs_E))])


def _wgrad_mm(a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor | None) -> torch.Tensor:
    """No autograd. Per expert e: a_e^T b_e, a [M, K] and b [M, N] split by offs_E (or [E, C, .]) -> [E, K, N]."""
    if offs_E is None:
        return torch.bmm(a.transpose(1, 2), b)
    if _native(a.dtype):
        return torch._grouped_mm(a.t(), b, offs=offs_E.to(torch.int32))
    return torch.stack([a[s:e].t() @ b[s:e] for s, e in _spans(offs_E)])


def grouped_mm(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Row block e of x (rows offs[e-1]:offs[e]) times w[e], differentiable: `_rows_mm` with the contiguous
    gradient native `_grouped_mm`'s backward requires."""
    w_EKN = w_EKN.to(x_MK.dtype)
    out = _rows_mm(x_MK, w_EKN, offs_E)
    return _ContiguousGrad.apply(out) if _native(x_MK.dtype) else out


class _GateUpGLU(torch.autograd.Function):
    """h = glu(x w1^T, x w3^T) per expert, with w1 and w3 run as one GEMM against their concatenation [E, 2I, L]
    (forward; and backward: dx = [dg du] W13 is one GEMM with a reduction of 2I instead of two of I plus a sum).
    The parameters stay w1 and w3. The concatenation is a transient copy, made again in the backward rather than
    kept: keeping it would hold one more copy of w1 + w3 for every MoE layer in flight (at K3 size, GBs per rank
    under pipeline parallelism). The weight gradients are two GEMMs on the halves of [dg du] (as fast as one on
    [E, 2I, L] plus the copies that would split it), so they come out contiguous. x: [M, L] rows split by
    offs_E, or [E, C, L] with offs_E None."""

    @staticmethod
    def forward(ctx, x, w1, w3, offs_E, act, beta_gate, beta_up):
        I = w1.shape[1]
        W13 = torch.cat([w1, w3], 1).to(x.dtype)  # [E, 2I, L]
        gu = _rows_mm(x, W13.transpose(1, 2), offs_E)  # [..., 2I]: gate columns, then up
        h, saved = glu_forward(gu[..., :I], gu[..., I:], act, beta_gate, beta_up)
        ctx.save_for_backward(x, w1, w3, offs_E, *saved)
        ctx.cfg = (act, beta_gate, beta_up, I, w1.dtype, w3.dtype)
        return h

    @staticmethod
    def backward(ctx, dh):
        act, beta_gate, beta_up, I, dt1, dt3 = ctx.cfg
        x, w1, w3, offs_E, *saved = ctx.saved_tensors
        dgu = x.new_empty(*x.shape[:-1], 2 * I)
        glu_backward(dh, saved, act, beta_gate, beta_up, dgate=dgu[..., :I], dup=dgu[..., I:])
        dx = _rows_mm(dgu, torch.cat([w1, w3], 1).to(x.dtype), offs_E) if ctx.needs_input_grad[0] else None
        dw1 = dw3 = None
        if ctx.needs_input_grad[1]:  # two GEMMs on the strided halves: contiguous [E, I, L] gradients, no copy
            dw1 = _wgrad_mm(dgu[..., :I], x, offs_E).to(dt1)
        if ctx.needs_input_grad[2]:
            dw3 = _wgrad_mm(dgu[..., I:], x, offs_E).to(dt3)
        return dx, dw1, dw3, None, None, None, None


class _DownCombine(torch.autograd.Function):
    """r[tok[m]] += w[m] * (h_m w2_e^T) in fp32 over all rows m: the down projection fused with the weighted
    combine (one EP rank, where the combine can follow the GEMM directly). The projected rows y are scaled in
    place and summed by one index_add into [num_rows, L], and are not kept: the routing weight's gradient
    g_m . y_m is computed as (g_m w2_e) . h_m, from the GEMM the backward needs anyway (dh = w * g w2_e), so
    the backward touches one [M, L] tensor (the gathered g) instead of three. Low-precision y (bf16) is kept
    and used as is, so the weight gradient stays g_fp32 . y as the late-weight contract has it."""

    @staticmethod
    def forward(ctx, h, w2, offs_E, w_M, tok_M, num_rows):
        w2t = w2.to(h.dtype).transpose(1, 2)
        y = _rows_mm(h, w2t, offs_E).reshape(-1, w2.shape[1])  # [M, L]
        exact = y.dtype in (torch.float32, torch.float64)
        yw = y if exact else y.float()
        yw.mul_(w_M.unsqueeze(-1).to(yw.dtype))
        out = yw.new_zeros(num_rows, yw.shape[-1]).index_add_(0, tok_M, yw)
        ctx.save_for_backward(h, w2, offs_E, w_M, tok_M, None if exact else y)
        ctx.w2_dtype = w2.dtype
        return out

    @staticmethod
    def backward(ctx, g_RL):
        h, w2, offs_E, w_M, tok_M, y = ctx.saved_tensors
        shape = h.shape[:-1] + (w2.shape[1],)  # [M, L] or [E, C, L]
        g = g_RL.index_select(0, tok_M)  # fp32 [M, L]
        w2h = w2.to(h.dtype)
        if y is None:  # fp32/fp64: g . y = (g w2) . h
            gw2 = _rows_mm(g.view(shape), w2h, offs_E)  # [..., I]
            dw = (gw2 * h).sum(-1).reshape(-1)
            dh = gw2.mul_(w_M.view(shape[:-1] + (1,)))
        else:
            dw = (g * y.float()).sum(-1)
            dh = None
        dy = g.mul_(w_M.unsqueeze(-1)).to(h.dtype).view(shape)
        if dh is None:
            dh = _rows_mm(dy, w2h, offs_E)
        dw2 = _wgrad_mm(dy, h, offs_E).to(ctx.w2_dtype) if ctx.needs_input_grad[1] else None  # [E, L, I]
        return dh, dw2, None, dw.to(w_M.dtype), None, None


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

    def _run(self, x: torch.Tensor, offs_E: torch.Tensor | None, combine=None) -> torch.Tensor:
        w1, w3, w2, q = self.w1, self.w3, self.w2, self.qat
        if q is not None:
            w1, w3, w2, x = q.weight(w1), q.weight(w3), q.weight(w2), q.act(x)
        h = _GateUpGLU.apply(x, w1, w3, offs_E, self.act, self.beta_gate, self.beta_up)
        if q is not None:
            h = q.act(h)
        if combine is not None:
            return _DownCombine.apply(h, w2, offs_E, *combine)
        w2t = w2.to(h.dtype).transpose(1, 2)
        return torch.bmm(h, w2t) if offs_E is None else grouped_mm(h, w2t, offs_E)

    def forward(self, z_ML: torch.Tensor, offs_E: torch.Tensor, combine=None) -> torch.Tensor:
        """Expert-sorted rows [M, L], offs_E the cumulative row count per expert -> [M, L] (grouped GEMMs).
        combine = (w_M, tok_M, num_rows): return instead the fp32 [num_rows, L] sum of w_M[m] * y_m into row
        tok_M[m] (the down projection fused with the dispatcher's combine)."""
        return self._run(z_ML, offs_E, combine)

    def forward_batched(self, x_ECL: torch.Tensor, combine=None) -> torch.Tensor:
        """Static shapes: C rows for each local expert, [El, C, L] -> [El, C, L], as batched GEMMs; `combine`
        as in `forward`, over the El * C rows."""
        return self._run(x_ECL, None, combine)

    def forward_reference(self, z_ML: torch.Tensor, expert_M: torch.Tensor) -> torch.Tensor:
        """Plain per-row reference (any dtype, any order): row m goes through expert expert_M[m]."""
        out = z_ML.new_zeros(z_ML.shape[0], self.width)
        for e in range(self.num_experts):
            rows = (expert_M == e).nonzero(as_tuple=True)[0]
            if rows.numel():
                z = z_ML[rows]
                h = glu_reference(z @ self.w1[e].T, z @ self.w3[e].T, self.act, self.beta_gate, self.beta_up)
                out[rows] = h @ self.w2[e].T
        return out
