"""SiTU-GLU (K3) and SwiGLU activations: the plain formula (`glu_reference`, the reference) and one autograd
Function (`GLU`, what `glu_act` runs for SiTU; SwiGLU measured faster as the plain formula) with a hand-written
derivative that the routed experts' fused GEMM Functions also call (`glu_forward` / `glu_backward`,
ops.grouped_gemm).

SiTU(g) = b1 * tanh(g / b1) * sigmoid(g): SiLU with its linear factor soft-capped at b1.
SiTU-GLU(g, u) = SiTU(g) * b2 * tanh(u / b2), bounded by b1 * b2. Computed in fp32.

Autograd of the plain formula keeps an intermediate per op and spends ~12 elementwise passes over [rows, I] on
situ's backward; the Function keeps what the derivative needs (silu: gate, up, silu(gate); situ: tanh(g/b1),
sigmoid(g), tanh(u/b2)), computes the derivative in 3 (silu) or 9 (situ) passes without transcendental
functions, and writes the gate and up gradients straight into the caller's buffers (the two halves of one
[rows, 2I] gradient for a fused gate/up GEMM).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .numerics import atleast_fp32, in_dtype

__all__ = ["ACTS", "situ", "glu_reference", "glu_forward", "glu_backward", "GLU", "glu_act"]

ACTS = ("situ", "silu")


def situ(g: torch.Tensor, beta: float = 4.0) -> torch.Tensor:
    gf = atleast_fp32(g)
    return beta * torch.tanh(gf / beta) * torch.sigmoid(gf)


def _check(act: str):
    if act not in ACTS:
        raise ValueError(f"unknown activation {act!r}; valid: 'situ', 'silu'")


def glu_reference(gate: torch.Tensor, up: torch.Tensor, act: str, beta_gate: float = 4.0, beta_up: float = 25.0):
    """The plain formula, autograd through every op: the reference `glu_act` must equal."""
    _check(act)
    if act == "situ":
        h = situ(gate, beta_gate) * (beta_up * torch.tanh(atleast_fp32(up) / beta_up))
    else:
        h = F.silu(atleast_fp32(gate)) * atleast_fp32(up)
    return h.to(gate.dtype)


def glu_forward(gate: torch.Tensor, up: torch.Tensor, act: str, beta_gate: float, beta_up: float):
    """(h in gate's dtype, the tensors `glu_backward` needs). gate/up may be strided views (the halves of one
    GEMM output); the math runs in fp32 (fp64 stays fp64)."""
    _check(act)
    g, u = atleast_fp32(gate), atleast_fp32(up)
    if act == "silu":
        a = F.silu(g)
        return in_dtype(torch.mul(a, u), gate.dtype), (gate, up, a)
    A = torch.div(g, beta_gate).tanh_()
    S = torch.sigmoid(g)
    T = torch.div(u, beta_up).tanh_()
    h = torch.addcmul(g.new_zeros(()), torch.mul(A, S), T, value=beta_gate * beta_up)
    return in_dtype(h, gate.dtype), (A, S, T)


def _into(out: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if out is None else out.copy_(value)


def glu_backward(dh: torch.Tensor, saved, act: str, beta_gate: float, beta_up: float,
                 dgate: torch.Tensor | None = None, dup: torch.Tensor | None = None):
    """(d gate, d up) from dL/dh, written into `dgate` / `dup` when given (any dtype and strides).
    silu: dg = silu'(g) u dh, du = silu(g) dh. situ, with A = tanh(g/b1), S = sigmoid(g), T = tanh(u/b2):
    dg = b2 T dh [S + A S (b1 - A - b1 S)], du = b1 A S (1 - T^2) dh. Recomputing A, S, T from gate/up instead
    of keeping them would cost two tanh (each slower than the whole derivative)."""
    dhf = atleast_fp32(dh)
    if act == "silu":
        gate, up, a = saved
        g, u = atleast_fp32(gate), atleast_fp32(up)
        # out= into the strided halves of one buffer saves a pass in eager; the compiler cannot trace an out= into a
        # non-contiguous tensor (a graph break) and fuses the copy anyway
        direct = not torch.compiler.is_compiling()
        if direct and dgate is not None and dgate.dtype == dhf.dtype:  # silu's own backward kernel, as autograd uses
            t = torch.mul(dhf, u, out=dgate)  # in place: elementwise, the output may alias the input
            dg = torch.ops.aten.silu_backward.grad_input(t, g, grad_input=dgate)
        else:
            dg = _into(dgate, torch.ops.aten.silu_backward(dhf * u, g))
        if direct and dup is not None and dup.dtype == a.dtype:
            du = torch.mul(dhf, a, out=dup)
        else:
            du = _into(dup, dhf * a)
        return dg, du
    A, S, T = saved
    zero = A.new_zeros(())
    AS = torch.mul(A, S)
    r = torch.addcmul(zero, dhf, AS, value=beta_gate)  # b1 A S dh
    du = torch.addcmul(r, torch.mul(r, T), T, value=-1.0)  # r (1 - T^2)
    K = torch.addcmul(S, AS, torch.add(A, S, alpha=beta_gate), value=-1.0).add_(AS, alpha=beta_gate)
    dg = torch.addcmul(zero, dhf, T, value=beta_up).mul_(K)
    return _into(dgate, dg), _into(dup, du)


class GLU(torch.autograd.Function):
    """h = act(gate) * f(up) with `glu_backward` as its derivative (see the module docstring)."""

    @staticmethod
    def forward(ctx, gate, up, act, beta_gate, beta_up):
        h, saved = glu_forward(gate, up, act, beta_gate, beta_up)
        ctx.save_for_backward(*saved)
        ctx.cfg = (act, beta_gate, beta_up, gate.dtype, up.dtype)
        return h

    @staticmethod
    def backward(ctx, dh):
        act, beta_gate, beta_up, gdt, udt = ctx.cfg
        dg, du = glu_backward(dh, ctx.saved_tensors, act, beta_gate, beta_up)
        return dg.to(gdt), du.to(udt), None, None, None


def glu_act(gate: torch.Tensor, up: torch.Tensor, act: str, beta_gate: float = 4.0, beta_up: float = 25.0):
    """The gated activation h = act(gate) * f(up), in fp32, returned in gate's dtype; equal to `glu_reference`
    to fp32 rounding. SiTU runs through the Function; SwiGLU is the plain formula, which measured faster than the
    Function both eager (1.22x) and compiled (1.09x) at [8192, 256] (bench/compile.py, bench/RESULTS.md), while the
    Function wins for SiTU (eager 1.26x, compiled 1.03x)."""
    if act == "silu":
        return glu_reference(gate, up, act)
    return GLU.apply(gate, up, act, beta_gate, beta_up)  # glu_forward checks `act`
