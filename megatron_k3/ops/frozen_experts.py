"""Routed experts frozen in the released MXFP4 encoding (issue 35's base for adapters): each matrix kind of a layer's
local experts kept as its E2M1 codes, two to a byte, and one E8M0 scale per 32 inputs (0.53 bytes per parameter,
`PackedExperts`), and the experts' forward over static [E, C, L] buffers (`frozen_experts_batched`) decoding only
`block` experts at a time, in the forward and again in the backward, which computes the input's gradient only (a
frozen base has none of its own). At no point are more than `block` experts' three matrices held decoded.

Legend as in ops.grouped_gemm: E local experts, C rows per expert, L expert width, I intermediate size.

The encoding is the release's (interop.k3_experts reads and writes it): packed [E, O, K/2] uint8 with the even
column in the low nibble, scale [E, O, K/32] uint8 (2^(s - 127)). Decoded values are exact in bf16 and fp32, so
the result equals the grouped GEMMs over the decoded weights, block for block; the dropless (expert-sorted rows)
path is not covered here: slicing its rows by expert block needs the offsets on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .glu import glu_backward, glu_forward
from .mx import dequantize_mx, pack_e2m1, quantize_mx, unpack_e2m1

__all__ = ["PackedExperts", "frozen_experts_batched", "MX_BLOCK"]

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


def _blocks(num: int, block: int):
    return [(e, min(e + block, num)) for e in range(0, num, block)]


class _FrozenExpertsBatched(torch.autograd.Function):
    """y[e] = w2[e] act(w1[e] x[e], w3[e] x[e]) per expert over [E, C, L], the weights decoded block by block; the
    backward gives x's gradient only."""

    @staticmethod
    def forward(ctx, x_ECL, w1, w3, w2, act, beta_gate, beta_up, block):
        E = x_ECL.shape[0]
        y = x_ECL.new_empty(E, x_ECL.shape[1], w2.shape[1])
        gates, ups = [], []
        for a, b in _blocks(E, block):
            x = x_ECL[a:b]
            g = torch.bmm(x, w1.decode(a, b, x.dtype).transpose(1, 2))
            u = torch.bmm(x, w3.decode(a, b, x.dtype).transpose(1, 2))
            h, _ = glu_forward(g, u, act, beta_gate, beta_up)
            y[a:b] = torch.bmm(h, w2.decode(a, b, x.dtype).transpose(1, 2))
            gates.append(g)
            ups.append(u)
        ctx.save_for_backward(torch.cat(gates), torch.cat(ups))
        ctx.cfg = (w1, w3, w2, act, beta_gate, beta_up, block, x_ECL.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        g_all, u_all = ctx.saved_tensors
        w1, w3, w2, act, beta_gate, beta_up, block, dtype = ctx.cfg
        dx = dy.new_empty(g_all.shape[0], g_all.shape[1], w1.shape[2], dtype=dtype)
        for a, b in _blocks(g_all.shape[0], block):
            g, u = g_all[a:b], u_all[a:b]
            dh = torch.bmm(dy[a:b].to(dtype), w2.decode(a, b, dtype))
            _, saved = glu_forward(g, u, act, beta_gate, beta_up)  # elementwise: cheaper to redo than to keep
            dg, du = glu_backward(dh, saved, act, beta_gate, beta_up)
            dx[a:b] = torch.bmm(dg.to(dtype), w1.decode(a, b, dtype)) + torch.bmm(du.to(dtype), w3.decode(a, b, dtype))
        return dx, None, None, None, None, None, None, None


def frozen_experts_batched(x_ECL: torch.Tensor, w1: PackedExperts, w3: PackedExperts, w2: PackedExperts, act: str,
                           beta_gate: float = 4.0, beta_up: float = 25.0, block: int = 8) -> torch.Tensor:
    """The experts' output [E, C, L] of inputs [E, C, L] (C rows per expert, static), w1/w3 decoding to [E, I, L]
    and w2 to [E, L, I]; at most `block` experts decoded at a time. Differentiable in x only."""
    E, _, L = x_ECL.shape
    if not (w1.shape == w3.shape and w1.shape[0] == E and w1.shape[2] == L and w2.shape == (E, L, w1.shape[1])):
        raise ValueError(f"frozen_experts_batched: x {tuple(x_ECL.shape)}, w1 {w1.shape}, w3 {w3.shape}, "
                         f"w2 {w2.shape}: expected w1/w3 [E, I, L] and w2 [E, L, I] for E={E}, L={L}")
    if block < 1:
        raise ValueError(f"frozen_experts_batched: block={block} must be >= 1")
    return _FrozenExpertsBatched.apply(x_ECL, w1, w3, w2, act, beta_gate, beta_up, block)
