"""The routed experts' GEMMs: grouped GEMMs over expert-sorted rows (or batched GEMMs over [E, C, .] buffers), the
fused gate/up GEMM + GLU and the down projection fused with the weighted combine, as autograd Functions with
hand-written backward passes; and `experts_reference`, the plain per-expert loop they must equal.

Legend: M routed rows (token-expert pairs, sorted by expert), L expert width (latent), I expert intermediate size,
E experts, C rows per expert (static buffers). offs_E holds the cumulative row count per expert (int32, on
device), so nothing syncs with the host on the grouped-GEMM path.

`GateUpGLU`: w1 and w3 as one GEMM against their per-step concatenation, then the GLU of ops.glu, derivative by
hand. `DownCombine`: down projection, fp32 routing weight and the weighted index_add into the token rows, for when
the combine can follow the experts directly. The weights keep their separate w1 / w3 / w2 layout ([out, in] per
expert).
"""

from __future__ import annotations

import torch

from .glu import glu_backward, glu_forward, glu_reference
from .numerics import atleast_fp32

__all__ = ["grouped_mm", "rows_mm", "wgrad_mm", "GateUpGLU", "GroupedDown", "DownCombine", "weighted_combine",
           "experts_reference"]

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
    # fallback for dtypes _grouped_mm lacks (e.g. float64 tests) and rows it refuses: a host sync is fine there
    ends = offs_E.tolist()
    return list(zip([0] + ends[:-1], ends))


def _native(dtype) -> bool:
    return dtype in _GROUPED_MM_DTYPES and hasattr(torch, "_grouped_mm")


def _aligned(*ts) -> bool:
    """Whether native grouped GEMMs take these operands: rows of a multiple of 16 bytes (a rank-3 LoRA
    intermediate in fp32 is not; the experts' own widths always are)."""
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in ts)


def _rows_mm(x: torch.Tensor, w: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    if _native(x.dtype) and _aligned(x, w):
        return torch._grouped_mm(x, w, offs=offs_E.to(torch.int32))
    return torch.cat([x[s:e] @ w[i] for i, (s, e) in enumerate(_spans(offs_E))])


def _wgrad_mm(a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    if _native(a.dtype) and _aligned(a, b):
        return torch._grouped_mm(a.t(), b, offs=offs_E.to(torch.int32))
    return torch.stack([a[s:e].t() @ b[s:e] for s, e in _spans(offs_E)])


# Under torch.compile the grouped GEMMs are opaque operators with their shapes given here: the tracer cannot run
# `_grouped_mm` on fake tensors for fp32 on CPU (its meta function accepts bf16 only), and the fp64 fallback
# reads the offsets on the host. Eager calls the functions directly.
@torch.library.custom_op("megatron_k3::rows_mm", mutates_args=())
def _rows_mm_op(x: torch.Tensor, w: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return _rows_mm(x, w, offs_E)


@_rows_mm_op.register_fake
def _(x, w, offs_E):
    return x.new_empty(x.shape[0], w.shape[-1])


def _rows_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _rows_mm_backward(ctx, g):  # differentiable `grouped_mm` (expert parallelism's down projection) under compile
    x, w, offs_E = ctx.saved_tensors
    g = g.contiguous()
    return _rows_mm_op(g, w.transpose(1, 2), offs_E), _wgrad_mm_op(x, g, offs_E), None


_rows_mm_op.register_autograd(_rows_mm_backward, setup_context=_rows_mm_setup)


@torch.library.custom_op("megatron_k3::wgrad_mm", mutates_args=())
def _wgrad_mm_op(a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return _wgrad_mm(a, b, offs_E)


@_wgrad_mm_op.register_fake
def _(a, b, offs_E):
    return a.new_empty(offs_E.shape[0], a.shape[-1], b.shape[-1])


def rows_mm(x: torch.Tensor, w: torch.Tensor, offs_E: torch.Tensor | None) -> torch.Tensor:
    """The GEMMs the Functions below run (autograd records them where it is on: `grouped_mm`). offs_E given: row
    block e of x [M, K] times w[e] [K, N] -> [M, N] (grouped GEMM); None: x [E, C, K] times w [E, K, N] (batched
    GEMM)."""
    if offs_E is None:
        return torch.bmm(x, w)
    return (_rows_mm_op if torch.compiler.is_compiling() else _rows_mm)(x, w, offs_E)


def wgrad_mm(a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor | None) -> torch.Tensor:
    """No autograd. Per expert e: a_e^T b_e, a [M, K] and b [M, N] split by offs_E (or [E, C, .]) -> [E, K, N]."""
    if offs_E is None:
        return torch.bmm(a.transpose(1, 2), b)
    return (_wgrad_mm_op if torch.compiler.is_compiling() else _wgrad_mm)(a, b, offs_E)


def grouped_mm(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Row block e of x (rows offs[e-1]:offs[e]) times w[e], differentiable: `rows_mm` with the contiguous
    gradient native `_grouped_mm`'s backward requires."""
    w_EKN = w_EKN.to(x_MK.dtype)
    out = rows_mm(x_MK, w_EKN, offs_E)
    return _ContiguousGrad.apply(out) if _native(x_MK.dtype) else out


class GateUpGLU(torch.autograd.Function):
    """h = glu(x w1^T, x w3^T) per expert, with w1 and w3 run as one GEMM against their concatenation [E, 2I, L]
    (forward; and backward: dx = [dg du] W13 is one GEMM with a reduction of 2I instead of two of I plus a sum).
    The parameters stay w1 and w3. The concatenation is a transient copy, made again in the backward rather than
    kept: keeping it would hold one more copy of w1 + w3 for every MoE layer in flight (at K3 size, GBs per rank
    under pipeline parallelism). The weight gradients are two GEMMs on the halves of [dg du] (as fast as one on
    [E, 2I, L] plus the copies that would split it), so they come out contiguous. x: [M, L] rows split by
    offs_E, or [E, C, L] with offs_E None. `wq` (precision=mx_qat): the weights' fake-quantisation, applied in place
    to the concatenation in the forward and again in the backward, so no quantised copy is kept (the gradients go
    straight through to w1, w3 and the replicas)."""

    @staticmethod
    def forward(ctx, x, w1, w3, offs_E, act, beta_gate, beta_up, r1=None, r3=None, rebuild=False, wq=None):
        I = w1.shape[1]
        W13 = _w13(w1, w3, r1, r3, wq, x.dtype)  # [E, 2I, L]
        gu = rows_mm(x, W13.transpose(1, 2), offs_E)  # [..., 2I]: gate columns, then up
        h, saved = glu_forward(gu[..., :I], gu[..., I:], act, beta_gate, beta_up)
        # rebuild (selective recomputation's moe_act): keep the GEMM's output and make the activation's fp32
        # intermediates again in the backward (the same values: the backward is bit-identical)
        ctx.save_for_backward(x, w1, w3, offs_E, r1, r3, *((gu,) if rebuild else saved))
        ctx.cfg = (act, beta_gate, beta_up, I, w1.dtype, w3.dtype, rebuild, wq)
        return h

    @staticmethod
    def backward(ctx, dh):
        act, beta_gate, beta_up, I, dt1, dt3, rebuild, wq = ctx.cfg
        x, w1, w3, offs_E, r1, r3, *saved = ctx.saved_tensors
        if rebuild:
            saved = glu_forward(saved[0][..., :I], saved[0][..., I:], act, beta_gate, beta_up)[1]
        dgu = x.new_empty(*x.shape[:-1], 2 * I)
        glu_backward(dh, saved, act, beta_gate, beta_up, dgate=dgu[..., :I], dup=dgu[..., I:])
        dx = rows_mm(dgu, _w13(w1, w3, r1, r3, wq, x.dtype), offs_E) if ctx.needs_input_grad[0] else None
        E = w1.shape[0]
        dw1 = dw3 = dr1 = dr3 = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[7]:  # two GEMMs on the strided halves: contiguous
            dw1 = wgrad_mm(dgu[..., :I], x, offs_E).to(dt1)  # [E, I, L] gradients, no copy
            if r1 is not None:
                dw1, dr1 = dw1[:E], dw1[E:]
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[8]:
            dw3 = wgrad_mm(dgu[..., I:], x, offs_E).to(dt3)
            if r3 is not None:
                dw3, dr3 = dw3[:E], dw3[E:]
        return dx, dw1, dw3, None, None, None, None, dr1, dr3, None, None


def _w13(w1, w3, r1, r3, wq, dtype):
    """The GEMM's [w1; w3] (with the replicas'), quantised by `wq` in place when QAT is on (the concatenation is a
    fresh tensor; quantisation runs along the last dim, so the concatenation's is each part's), in `dtype`."""
    W13 = _cat13(w1, w3, r1, r3)
    return (W13 if wq is None else wq(W13)).to(dtype)


def _down(w2, r2, wq, dtype):
    """The down GEMM's weights: w2 with the replicas' r2 after it (or w2 alone), quantised by `wq` on a copy when QAT
    is on, in `dtype`."""
    if r2 is not None:
        W = torch.cat([w2, r2])
    else:
        W = w2 if wq is None else w2.clone(memory_format=torch.contiguous_format)
    return (W if wq is None else wq(W)).to(dtype)


def _cat13(w1, w3, r1, r3):
    """[E (+ replicas), 2I, L]: gate and up weights of every group, the replicas' after the own experts', written
    into one new tensor (in torch.cat's promoted dtype; concatenating the two concatenations would hold them too,
    twice the workspace at once)."""
    if r1 is None:
        return torch.cat([w1, w3], 1)
    E, I = w1.shape[0], w1.shape[1]
    dtype = torch.promote_types(torch.promote_types(w1.dtype, w3.dtype), torch.promote_types(r1.dtype, r3.dtype))
    out = w1.new_empty((E + r1.shape[0], 2 * I) + tuple(w1.shape[2:]), dtype=dtype)
    out[:E, :I], out[:E, I:], out[E:, :I], out[E:, I:] = w1, w3, r1, r3
    return out


class GroupedDown(torch.autograd.Function):
    """y = h w2_e^T per row group, with the weights of the groups given as the own experts' w2 followed by
    replicas r2 (or w2 alone, r2 None): one grouped GEMM against their transient concatenation, which is not kept
    (the parameter and the received replicas are), so no copy of the own experts lives until the backward. `wq`
    (precision=mx_qat): the weights' fake-quantisation, applied to that transient copy in the forward and again in
    the backward (the same values; the gradient goes straight through to w2 and r2)."""

    @staticmethod
    def forward(ctx, h, w2, r2, offs_E, wq=None):
        W = _down(w2, r2, wq, h.dtype)
        ctx.save_for_backward(h, w2, r2, offs_E)
        ctx.wq = wq
        return rows_mm(h, W.transpose(1, 2), offs_E)

    @staticmethod
    def backward(ctx, dy):
        h, w2, r2, offs_E = ctx.saved_tensors
        dy = dy.contiguous()
        dh = rows_mm(dy, _down(w2, r2, ctx.wq, h.dtype), offs_E) if ctx.needs_input_grad[0] else None
        dw = wgrad_mm(dy, h, offs_E)  # [E + S, L, I]
        E = w2.shape[0]
        return dh, dw[:E].to(w2.dtype), None if r2 is None else dw[E:].to(r2.dtype), None, None


class DownCombine(torch.autograd.Function):
    """r[tok[m]] += w[m] * (h_m w2_e^T) in fp32 over all rows m: the down projection fused with the weighted
    combine (one EP rank, where the combine can follow the GEMM directly). The projected rows y are scaled in
    place and summed by one index_add into [num_rows, L], and are not kept: the routing weight's gradient
    g_m . y_m is computed as (g_m w2_e) . h_m, from the GEMM the backward needs anyway (dh = w * g w2_e), so
    the backward touches one [M, L] tensor (the gathered g) instead of three. Low-precision y (bf16) is kept
    and used as is, so the weight gradient stays g_fp32 . y as the late-weight contract has it."""

    @staticmethod
    def forward(ctx, h, w2, offs_E, w_M, tok_M, num_rows, wq=None):
        w2t = _down(w2, None, wq, h.dtype).transpose(1, 2)
        y = rows_mm(h, w2t, offs_E).reshape(-1, w2.shape[1])  # [M, L]
        exact = y.dtype in (torch.float32, torch.float64)
        yw = y if exact else y.float()
        yw.mul_(w_M.unsqueeze(-1).to(yw.dtype))
        out = yw.new_zeros(num_rows, yw.shape[-1])
        # compiled: out of place (what functionalisation makes of it anyway): torch 2.11's Dynamo gives an
        # autograd.Function's output that its forward mutated in place no gradient (silently zero)
        out = out.index_add(0, tok_M, yw) if torch.compiler.is_compiling() else out.index_add_(0, tok_M, yw)
        ctx.save_for_backward(h, w2, offs_E, w_M, tok_M, None if exact else y)
        ctx.w2_dtype, ctx.wq = w2.dtype, wq
        return out

    @staticmethod
    def backward(ctx, g_RL):
        h, w2, offs_E, w_M, tok_M, y = ctx.saved_tensors
        shape = h.shape[:-1] + (w2.shape[1],)  # [M, L] or [E, C, L]
        g = g_RL.index_select(0, tok_M)  # fp32 [M, L]
        w2h = _down(w2, None, ctx.wq, h.dtype)
        if y is None:  # fp32/fp64: g . y = (g w2) . h
            gw2 = rows_mm(g.view(shape), w2h, offs_E)  # [..., I]
            dw = (gw2 * h).sum(-1).reshape(-1)
            dh = gw2.mul_(w_M.view(shape[:-1] + (1,)))
        else:
            dw = (g * y.float()).sum(-1)
            dh = None
        dy = g.mul_(w_M.unsqueeze(-1)).to(h.dtype).view(shape)
        if dh is None:
            dh = rows_mm(dy, w2h, offs_E)
        dw2 = wgrad_mm(dy, h, offs_E).to(ctx.w2_dtype) if ctx.needs_input_grad[1] else None  # [E, L, I]
        return dh, dw2, None, dw.to(w_M.dtype), None, None, None


def weighted_combine(y_SL: torch.Tensor, w_S: torch.Tensor, tok_S: torch.Tensor, num_rows: int) -> torch.Tensor:
    """r[t] = sum over rows s with tok_S[s] = t of w_S[s] * y[s], in fp32: one weighted index_add into [num_rows,
    L] (its backward is a gather), instead of un-sorting the rows into [N, k, L] and reducing over k."""
    out = torch.zeros(num_rows, y_SL.shape[-1], dtype=torch.promote_types(y_SL.dtype, torch.float32),
                      device=y_SL.device)
    return out.index_add_(0, tok_S, atleast_fp32(y_SL) * w_S.unsqueeze(-1))


def experts_reference(z_ML: torch.Tensor, expert_M: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                      w2: torch.Tensor, act: str, beta_gate: float = 4.0, beta_up: float = 25.0) -> torch.Tensor:
    """Plain per-row reference (any dtype, any order): row m goes through expert expert_M[m], autograd through every
    op; w1/w3 [E, I, L], w2 [E, L, I]."""
    out = z_ML.new_zeros(z_ML.shape[0], w2.shape[1])
    for e in range(w1.shape[0]):
        rows = (expert_M == e).nonzero(as_tuple=True)[0]
        if rows.numel():
            z = z_ML[rows]
            h = glu_reference(z @ w1[e].T, z @ w3[e].T, act, beta_gate, beta_up)
            out[rows] = h @ w2[e].T
    return out
