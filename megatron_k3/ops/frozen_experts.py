"""Routed experts frozen in the released MXFP4 encoding (issue 35's base for adapters): each matrix kind of a layer's
local experts kept as its E2M1 codes, two to a byte, and one E8M0 scale per 32 inputs (0.53 bytes per parameter,
`PackedExperts`), and the experts' forward over static [E, C, L] buffers (`frozen_experts_batched`) decoding only
`block` experts at a time, in the forward and again in the backward, which computes the input's gradient only (a
frozen base has none of its own). At no point are more than `block` experts' three matrices held decoded. Per-expert
low-rank adapters (`ExpertAdapters`: w + scale * B A for each of w1, w3, w2) run beside the frozen matrices as
batched GEMMs through the rank-r intermediate, never merged, and take their gradients in the same backward.

Legend as in ops.grouped_gemm: E local experts, C rows per expert, L expert width, I intermediate size.

The encoding is the release's (interop.k3_experts reads and writes it): packed [E, O, K/2] uint8 with the even
column in the low nibble, scale [E, O, K/32] uint8 (2^(s - 127)). Decoded values are exact in bf16 and fp32, so
the result equals the GEMMs over the decoded weights, block for block. `frozen_experts_grouped` runs the same over
expert-sorted rows (the dropless path) as grouped GEMMs per block; slicing the rows by expert block reads the
offsets on the host, once per forward (the static path reads nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .glu import glu_backward, glu_forward
from .grouped_gemm import rows_mm, wgrad_mm
from .mx import dequantize_mx, pack_e2m1, quantize_mx, unpack_e2m1

__all__ = ["PackedExperts", "ExpertAdapters", "frozen_experts_batched", "frozen_experts_grouped", "MX_BLOCK"]

MX_BLOCK = 32  # inputs per E8M0 scale


@dataclass(frozen=True)
class PackedExperts:
    """One matrix kind (w1, w3 or w2) of E experts, [E, O, K] as stored: packed [E, O, K/2] and scale [E, O, K/32],
    both uint8."""
    packed: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self):
        p, s = self.packed, self.scale
        if p.dtype != torch.uint8 or s.dtype != torch.uint8 or p.dim() != 3 or \
                s.shape != (p.shape[0], p.shape[1], p.shape[2] * 2 // MX_BLOCK) or (p.shape[2] * 2) % MX_BLOCK:
            raise ValueError(f"PackedExperts: packed {tuple(p.shape)} {p.dtype} and scale {tuple(s.shape)} {s.dtype} "
                             f"are not uint8 [E, O, K/2] and [E, O, K/{MX_BLOCK}]")

    @classmethod
    def encode(cls, w_EOK: torch.Tensor, scale_mode: str = "floor") -> "PackedExperts":
        """The MXFP4 encoding of weights [E, O, K] (our quantiser's: ops.mx)."""
        codes, scale = quantize_mx(w_EOK, "e2m1", MX_BLOCK, scale_mode)
        return cls(pack_e2m1(codes), scale)

    @property
    def num_experts(self) -> int:
        return self.packed.shape[0]

    @property
    def shape(self) -> tuple:
        """The decoded shape [E, O, K]."""
        return (self.packed.shape[0], self.packed.shape[1], self.packed.shape[2] * 2)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale.numel()

    def decode(self, start: int = 0, stop: int | None = None, dtype=torch.float32) -> torch.Tensor:
        """Experts [start, stop) decoded: [stop - start, O, K] in `dtype` (exact for bf16 and fp32)."""
        stop = self.num_experts if stop is None else stop
        return dequantize_mx(unpack_e2m1(self.packed[start:stop]), self.scale[start:stop], "e2m1", MX_BLOCK, dtype)


@dataclass(frozen=True)
class ExpertAdapters:
    """Per-expert low-rank adapters of the three matrices: w_eff[e] = w[e] + scale * B[e] @ A[e], A [E, r, in] and
    B [E, out, r] for w1, w3 (in = L, out = I) and w2 (in = I, out = L); run as per-expert GEMMs beside the frozen
    ones, never merged."""
    a1: torch.Tensor
    b1: torch.Tensor
    a3: torch.Tensor
    b3: torch.Tensor
    a2: torch.Tensor
    b2: torch.Tensor
    scale: float

    def tensors(self) -> tuple:
        return (self.a1, self.b1, self.a3, self.b3, self.a2, self.b2)


class _Spans:
    """Where each block of experts lies in x: static [E, C, .] buffers (offs_E None), or expert-sorted rows [M, .]
    split by offs_E, read on the host once (one sync: slicing rows by expert block needs the row counts)."""

    def __init__(self, offs_E: torch.Tensor | None, num: int, block: int):
        self.grouped = offs_E is not None
        self.offs = offs_E
        self.ends = offs_E.tolist() if self.grouped else None
        self.blocks = []
        for lo in range(0, num, block):
            hi = min(lo + block, num)
            rows = (0 if lo == 0 else self.ends[lo - 1], self.ends[hi - 1]) if self.grouped else (lo, hi)
            self.blocks.append((lo, hi, slice(*rows)))

    def local_offs(self, lo: int, hi: int, rows: slice):
        """Block [lo, hi)'s row offsets within its rows (device), or None (batched)."""
        return self.offs[lo:hi] - rows.start if self.grouped else None


def _lowrank(x, a, b, scale, offs):
    """scale * (x a^T) b^T per expert: the adapter's term (rows_mm / wgrad_mm: batched with offs None, else
    grouped)."""
    return rows_mm(rows_mm(x, a.transpose(1, 2), offs), b.transpose(1, 2), offs).mul_(scale)


def _lowrank_backward(dy, x, a, b, scale, offs):
    """Gradients of scale * (x a^T) b^T: (dx term, da, db); the rank-r intermediate x a^T made again."""
    t = rows_mm(x, a.transpose(1, 2), offs)
    dt = rows_mm(dy, b, offs).mul_(scale)
    return rows_mm(dt, a, offs), wgrad_mm(dt, x, offs), wgrad_mm(dy, t, offs).mul_(scale)


class _FrozenExperts(torch.autograd.Function):
    """y = w2[e] act(w1[e] x, w3[e] x) per expert (static [E, C, L] buffers or expert-sorted rows), the frozen
    weights decoded block by block, plus the adapters' terms where given; the backward gives x's gradient and the
    adapters'. The gate and up GEMMs run as one against the block's decoded [w1; w3], as GateUpGLU runs them for
    trained experts, so the base's terms are the same GEMMs and the result equals the bf16/fp32 experts' bit for
    bit. `act_q` (precision=mx_qat: the MXFP8 activation quantiser, straight-through) is applied to h before the
    down GEMM and its adapter, as GroupedExperts applies it."""

    @staticmethod
    def forward(ctx, x, offs_E, w1, w3, w2, act, beta_gate, beta_up, block, scale, act_q, *ab):
        spans = _Spans(offs_E, w1.num_experts, block)
        y = x.new_empty(*x.shape[:-1], w2.shape[1])
        gus, I = [], w1.shape[1]
        for lo, hi, rows in spans.blocks:
            xb, offs = x[rows], spans.local_offs(lo, hi, rows)
            w13 = torch.cat([w1.decode(lo, hi, x.dtype), w3.decode(lo, hi, x.dtype)], 1)
            gu = rows_mm(xb, w13.transpose(1, 2), offs)
            del w13
            if ab:
                gu[..., :I] += _lowrank(xb, ab[0][lo:hi], ab[1][lo:hi], scale, offs)
                gu[..., I:] += _lowrank(xb, ab[2][lo:hi], ab[3][lo:hi], scale, offs)
            h, _ = glu_forward(gu[..., :I], gu[..., I:], act, beta_gate, beta_up)
            if act_q is not None:
                h = act_q(h)
            y[rows] = rows_mm(h, w2.decode(lo, hi, x.dtype).transpose(1, 2), offs)
            if ab:
                y[rows] += _lowrank(h, ab[4][lo:hi], ab[5][lo:hi], scale, offs)
            gus.append(gu)
        ctx.save_for_backward(x if ab else None, torch.cat(gus), *ab)
        ctx.cfg = (spans, w1, w3, w2, act, beta_gate, beta_up, scale, x.dtype, act_q)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_all, gu_all, *ab = ctx.saved_tensors
        spans, w1, w3, w2, act, beta_gate, beta_up, scale, dtype, act_q = ctx.cfg
        I = w1.shape[1]
        dx = dy.new_empty(*gu_all.shape[:-1], w1.shape[2], dtype=dtype)
        dab = [torch.zeros_like(t) for t in ab]
        for lo, hi, rows in spans.blocks:
            gu, d, offs = gu_all[rows], dy[rows].to(dtype), spans.local_offs(lo, hi, rows)
            dh = rows_mm(d, w2.decode(lo, hi, dtype), offs)
            h, saved = glu_forward(gu[..., :I], gu[..., I:], act, beta_gate, beta_up)  # cheaper to redo than keep
            if ab:
                a, b = ab[4][lo:hi], ab[5][lo:hi]
                dh_ab, dab[4][lo:hi], dab[5][lo:hi] = _lowrank_backward(d, h if act_q is None else act_q(h), a, b,
                                                                        scale, offs)
                dh = dh + dh_ab
            dgu = torch.cat([v.to(dtype) for v in glu_backward(dh, saved, act, beta_gate, beta_up)], -1)
            w13 = torch.cat([w1.decode(lo, hi, dtype), w3.decode(lo, hi, dtype)], 1)
            dx[rows] = rows_mm(dgu, w13, offs)
            del w13
            if ab:
                xb = x_all[rows]
                for k, dz in ((0, dgu[..., :I]), (2, dgu[..., I:])):
                    a, b = ab[k][lo:hi], ab[k + 1][lo:hi]
                    dx_ab, dab[k][lo:hi], dab[k + 1][lo:hi] = _lowrank_backward(dz.contiguous(), xb, a, b, scale,
                                                                                offs)
                    dx[rows] += dx_ab
        return (dx, None, None, None, None, None, None, None, None, None, None, *dab)


def _run(x, offs_E, w1, w3, w2, act, beta_gate, beta_up, block, adapters, what, act_q):
    if block < 1:
        raise ValueError(f"{what}: block={block} must be >= 1")
    if adapters is None:
        return _FrozenExperts.apply(x, offs_E, w1, w3, w2, act, beta_gate, beta_up, block, 0.0, act_q)
    _check_adapters(adapters, w1.num_experts, w1.shape[2], w1.shape[1])
    return _FrozenExperts.apply(x, offs_E, w1, w3, w2, act, beta_gate, beta_up, block, float(adapters.scale), act_q,
                                *adapters.tensors())


def _check_weights(what: str, x, w1, w3, w2, E: int) -> None:
    L = x.shape[-1]
    if not (w1.shape == w3.shape and w1.shape[0] == E and w1.shape[2] == L and w2.shape == (E, L, w1.shape[1])):
        raise ValueError(f"{what}: x {tuple(x.shape)}, w1 {w1.shape}, w3 {w3.shape}, w2 {w2.shape}: expected "
                         f"w1/w3 [E, I, L] and w2 [E, L, I] for E={E}, L={L}")


def frozen_experts_batched(x_ECL: torch.Tensor, w1: PackedExperts, w3: PackedExperts, w2: PackedExperts, act: str,
                           beta_gate: float = 4.0, beta_up: float = 25.0, block: int = 8,
                           adapters: ExpertAdapters | None = None, act_q=None) -> torch.Tensor:
    """The experts' output [E, C, L] of inputs [E, C, L] (C rows per expert, static), w1/w3 decoding to [E, I, L]
    and w2 to [E, L, I]; at most `block` experts decoded at a time. Differentiable in x and in the `adapters`
    (per-expert low-rank terms beside each frozen matrix), never in the frozen weights. No host read. `act_q`: a
    straight-through quantiser of the down GEMM's input (precision=mx_qat), or None."""
    _check_weights("frozen_experts_batched", x_ECL, w1, w3, w2, x_ECL.shape[0])
    return _run(x_ECL, None, w1, w3, w2, act, beta_gate, beta_up, block, adapters, "frozen_experts_batched", act_q)


def frozen_experts_grouped(z_ML: torch.Tensor, offs_E: torch.Tensor, w1: PackedExperts, w3: PackedExperts,
                           w2: PackedExperts, act: str, beta_gate: float = 4.0, beta_up: float = 25.0, block: int = 8,
                           adapters: ExpertAdapters | None = None, act_q=None) -> torch.Tensor:
    """`frozen_experts_batched` over expert-sorted rows [M, L] (offs_E: the cumulative row count per local expert,
    the dropless path), as grouped GEMMs per block of experts; reads offs_E on the host once per forward."""
    _check_weights("frozen_experts_grouped", z_ML, w1, w3, w2, offs_E.shape[0])
    return _run(z_ML, offs_E, w1, w3, w2, act, beta_gate, beta_up, block, adapters, "frozen_experts_grouped", act_q)


def _check_adapters(ad: ExpertAdapters, E: int, L: int, I: int) -> None:
    r = ad.a1.shape[1]
    want = {"a1": (E, r, L), "b1": (E, I, r), "a3": (E, r, L), "b3": (E, I, r), "a2": (E, r, I), "b2": (E, L, r)}
    for name, shape in want.items():
        got = tuple(getattr(ad, name).shape)
        if got != shape:
            raise ValueError(f"ExpertAdapters.{name}: shape {got}, expected {shape} (E={E}, rank={r}, L={L}, I={I})")
