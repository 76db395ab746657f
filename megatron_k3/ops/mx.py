"""OCP Microscaling (MX v1.0) block formats in plain torch: E2M1 / E4M3 / E5M2 elements sharing one E8M0
scale per block of 32 along the last dimension, the K3 packing of E2M1 codes, and a straight-through
fake-quantiser for QAT.

Legend: ... leading dims, N blocks along the last dim, K block size (32).

Conversion (per block V of K values, inputs rounded to fp32 first):
  scale_mode "floor" (the spec, OCP MX v1.0 section 6.3):
      X = 2^(floor(log2 max|V|) - emax_elem), exponent clamped to the E8M0 range [-127, 127];
      an all-zero block gets the smallest scale, 2^-127 (code 0).
  scale_mode "rceil" (cuBLAS / Blackwell hardware):
      X = 2^ceil(log2(fp32(max|V| / max_elem))), computed exactly on the bits, never overflows the element.
  P_i = V_i / X rounded to the element grid, round-to-nearest-even, subnormals kept, finite values beyond the
  largest normal saturated to +-max normal (sign kept; -0 keeps its sign bit).
Special values:
  * a NaN anywhere in a block makes its scale NaN (E8M0 0xFF); the element codes of a NaN-scale block carry
    no information (we write the format's NaN code, 0 for E2M1) and decode to NaN.
  * floor: an Inf in a block makes its scale NaN too: floor(log2 Inf) - emax overflows E8M0, which has no
    Inf, and E2M1/E4M3 cannot hold an Inf element (this is the behaviour of the spec authors' reference,
    microsoft/microxcaling). rceil follows the hardware's satfinite conversion instead: the scale
    saturates to 2^127 (0xFE) and the Inf element saturates to +-max normal.
Decoding: w = value(code) * 2^(scale - 127); scale 0xFF decodes the whole block to NaN; E4M3 code
S.1111.111 is NaN; E5M2 S.11111.00 is Inf and S.11111.{01,10,11} NaN.

Bit-exactness: V / X and value * X are products with powers of two, done as two multiplications by normal
powers of two (never a subnormal constant), so they are exact whenever the result is representable, on any
device, with or without flush-to-zero of denormal operands.

Round-trip error bound (finite blocks), with E = floor(log2 max|V|), m the element's mantissa bits:
  floor: |V_i - q_i| <= 2^(E - m - 1) for every element not saturated, and a saturated element (only the top
         of the block: |V_i| > max_elem * X) is off by less than 2^(E + 1) - max_elem * X, which is
         2^(E - 1) for E2M1 and 2^(E - 2) for E4M3 / E5M2.
  rceil: no element saturates; |V_i - q_i| <= X * 2^(emax_elem - m - 1) <= 2^(E - m) (half a step of the
         top binade of the scaled block).
  Elements in the element's normal range are also within a relative 2^-(m + 1) of their value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .numerics import in_dtype

E8M0_BIAS = 127
E8M0_NAN = 255


@dataclass(frozen=True)
class ElemFormat:
    name: str
    ebits: int
    mbits: int
    bias: int
    max_normal: float
    has_inf: bool
    nan_code: int  # the positive NaN encoding; 0 where the format has none (E2M1)

    @property
    def emax(self) -> int:
        """Exponent of the largest normal (emax_elem in the spec)."""
        return math.frexp(self.max_normal)[1] - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal."""
        return 1 - self.bias

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits


FORMATS = {
    "e2m1": ElemFormat("e2m1", 2, 1, 1, 6.0, False, 0),
    "e4m3": ElemFormat("e4m3", 4, 3, 7, 448.0, False, 0x7F),
    "e5m2": ElemFormat("e5m2", 5, 2, 15, 57344.0, True, 0x7F),
}
SCALE_MODES = ("floor", "rceil")


def elem_format(fmt) -> ElemFormat:
    if isinstance(fmt, ElemFormat):
        return fmt
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown MX element format {fmt!r}; valid: {', '.join(FORMATS)}") from None


# ---------------------------------------------------------------------------------------------- bit helpers
def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as fp32 for integer e in [-126, 127], built from the exponent bits (exact, no libm)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _mul_pow2(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """x * 2^e for integer e in [-252, 254], as two multiplications by normal powers of two.

    The first factor takes floor(e / 2): when e < 0 it is the larger shift, so a representable result is
    reached with one rounding at most; intermediate underflow only happens for results far below any
    element's rounding threshold."""
    a = torch.div(e, 2, rounding_mode="floor")
    return x * _pow2(a) * _pow2(e - a)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 a) for finite a > 0, exact (subnormals included); a = 0 gives -1, callers clamp it."""
    return torch.frexp(a).exponent - 1


def _check(x: torch.Tensor, block_size: int, scale_mode: str | None = None):
    if block_size <= 0 or x.dim() == 0 or x.shape[-1] % block_size:
        raise ValueError(f"MX: the last dimension {tuple(x.shape)[-1:] or '()'} must be a multiple of "
                         f"block_size={block_size}")
    if scale_mode is not None and scale_mode not in SCALE_MODES:
        raise ValueError(f"unknown MX scale_mode {scale_mode!r}; valid: {', '.join(SCALE_MODES)}")


# ---------------------------------------------------------------------------------------------- core
def _scale_exponent(amax_N: torch.Tensor, f: ElemFormat, scale_mode: str):
    """(unbiased scale exponent s in [-127, 127] as int32, NaN-scale mask) per block."""
    if scale_mode == "floor":
        # floor(log2 amax) from the exponent bits; zero and subnormal amax give <= -127, clamped below
        e = ((amax_N.view(torch.int32) >> 23) & 0xFF) - 127
        s = (e - f.emax).clamp(-127, 127)
        nan = ~torch.isfinite(amax_N)  # NaN, or Inf: the scale would overflow E8M0
    else:
        d = amax_N / f.max_normal  # correctly rounded; a quotient just above 2^k never rounds down onto 2^k
        bits = d.view(torch.int32)
        be, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        s = be - 127 + (mant != 0).to(torch.int32)  # exact ceil(log2 d) for normal d
        # subnormal d in (2^-127, 2^-126) rounds up to 2^-126; d <= 2^-127 (or 0) to the E8M0 minimum
        s = torch.where(be == 0, torch.where(mant > (1 << 22), -126, -127), s).clamp(-127, 127)
        s = torch.where(torch.isinf(d), 127, s)  # satfinite: Inf amax -> 2^127
        nan = torch.isnan(d)
    return s.to(torch.int32), nan


def _round_to_elem(y: torch.Tensor, f: ElemFormat) -> torch.Tensor:
    """|y| rounded to the element grid (RNE, subnormals, saturating at max normal); NaN stays NaN."""
    a = y.abs()
    e = _floor_log2(a).clamp(min=f.emin)  # the binade whose step applies (subnormals use emin's)
    step = e - f.mbits
    r = torch.round(_mul_pow2(a, -step))  # exact scaling, then round half to even
    return _mul_pow2(r, step).clamp(max=f.max_normal)


def _encode(r: torch.Tensor, neg: torch.Tensor, f: ElemFormat) -> torch.Tensor:
    """Codes (uint8) of grid magnitudes r with sign bits neg."""
    normal = r >= 2.0 ** f.emin
    e = _floor_log2(r).clamp(min=f.emin)
    frac = _mul_pow2(r, f.mbits - e)  # in [2^m, 2^(m+1)) for normals, [0, 2^m) for subnormals
    mant = torch.where(normal, frac - (1 << f.mbits), frac).to(torch.int32)
    biased = torch.where(normal, e + f.bias, 0)
    code = (neg.to(torch.int32) << (f.ebits + f.mbits)) | (biased << f.mbits) | mant
    return code.to(torch.uint8)


def _quantize_blocks(x: torch.Tensor, f: ElemFormat, block_size: int, scale_mode: str):
    """Blocked view of x and its quantisation: (sign mask, grid magnitudes r, scale exponents, NaN blocks)."""
    _check(x, block_size, scale_mode)
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    amax = xb.abs().amax(-1)  # NaN if the block holds a NaN
    s, nan = _scale_exponent(amax, f, scale_mode)
    y = _mul_pow2(xb, -s.unsqueeze(-1))  # V / X, exact
    r = _round_to_elem(y, f)
    return torch.signbit(xb), r, s, nan


def quantize_mx(x: torch.Tensor, fmt: str, block_size: int = 32, scale_mode: str = "floor"):
    """x [..., K*N] -> (codes uint8 [..., K*N], one element code per value (E2M1 unpacked: see pack_e2m1),
    scales uint8 [..., N], E8M0 biased exponents). Blocks of block_size run along the last dimension."""
    f = elem_format(fmt)
    neg, r, s, nan = _quantize_blocks(x, f, block_size, scale_mode)
    codes = _encode(torch.where(torch.isnan(r), 0.0, r), neg, f)
    codes = torch.where(nan.unsqueeze(-1), torch.tensor(f.nan_code, dtype=torch.uint8, device=x.device), codes)
    scales = torch.where(nan, E8M0_NAN, s + E8M0_BIAS).to(torch.uint8)
    return codes.reshape(x.shape), scales


def encode_at_scales(x: torch.Tensor, fmt: str, scales: torch.Tensor, block_size: int = 32):
    """x [..., K*N] encoded at given E8M0 scales [..., N] (uint8) instead of computed ones: (codes [..., K*N],
    exact [..., N]) where `exact` marks the blocks whose values those codes and scales reproduce exactly (no
    rounding, no saturation, no NaN scale). Used to keep a checkpoint's own encoding of values that did not change
    (interop.k3_experts): MX encodings are not unique, e.g. 3 * 2^s is also 6 * 2^(s-1)."""
    f = elem_format(fmt)
    _check(x, block_size)
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    s = scales.to(torch.int32) - E8M0_BIAS
    y = _mul_pow2(xb, -s.unsqueeze(-1))
    r = _round_to_elem(y, f)
    exact = ((r == y.abs()) & (y.abs() <= f.max_normal)).all(-1) & (scales != E8M0_NAN)
    codes = _encode(torch.where(torch.isnan(r), 0.0, r), torch.signbit(xb), f)
    return codes.reshape(x.shape), exact


_LUTS: dict = {}


def elem_values(fmt: str, device=None) -> torch.Tensor:
    """fp32 value of every code of the format (2^bits entries): the decoding table."""
    f = elem_format(fmt)
    key = (f.name, str(device))
    if key not in _LUTS:
        c = torch.arange(1 << f.bits, dtype=torch.int32)
        sign = torch.where((c >> (f.ebits + f.mbits)) & 1 == 1, -1.0, 1.0)
        biased, mant = (c >> f.mbits) & ((1 << f.ebits) - 1), c & ((1 << f.mbits) - 1)
        sub = mant.float() * 2.0 ** (f.emin - f.mbits)
        nrm = (1.0 + mant.float() / (1 << f.mbits)) * torch.exp2((biased - f.bias).float())
        v = sign * torch.where(biased == 0, sub, nrm)
        top = biased == (1 << f.ebits) - 1
        if f.name == "e4m3":
            v = torch.where(top & (mant == (1 << f.mbits) - 1), float("nan"), v)
        elif f.has_inf:
            v = torch.where(top, torch.where(mant == 0, sign * float("inf"), float("nan")), v)
        _LUTS[key] = v.to(device)
    return _LUTS[key]


def dequantize_mx(codes: torch.Tensor, scales: torch.Tensor, fmt: str, block_size: int = 32,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(codes [..., K*N] unpacked, scales [..., N]) -> values [..., K*N] = value(code) * 2^(scale - 127)."""
    _check(codes, block_size)
    if scales.shape != codes.shape[:-1] + (codes.shape[-1] // block_size,):
        raise ValueError(f"MX: scales shape {tuple(scales.shape)} does not match codes {tuple(codes.shape)} "
                         f"with block_size={block_size}")
    v = elem_values(fmt, codes.device)[codes.long()]
    v = v.reshape(*scales.shape, block_size)
    s = scales.to(torch.int32).unsqueeze(-1)
    out = torch.where(s == E8M0_NAN, float("nan"), _mul_pow2(v, s - E8M0_BIAS))
    return out.reshape(codes.shape).to(dtype)


# elements quantised at once by mx_round_trip: its fp32 / int32 temporaries (ROUND_TRIP_BYTES_PER_ELEMENT each) are
# one chunk's, not the tensor's (a K3 rank's 14 experts' w1 is 155M elements: 6 GB of temporaries in one piece)
ROUND_TRIP_CHUNK = 1 << 24
ROUND_TRIP_BYTES_PER_ELEMENT = 45  # the temporaries' peak per element of a chunk, its output's included: 44.3 in bf16,
# 40.3 in fp32 (tests/test_mx.py measures it)


def _round_trip_rows(x: torch.Tensor, f: ElemFormat, block_size: int, scale_mode: str) -> torch.Tensor:
    neg, r, s, nan = _quantize_blocks(x, f, block_size, scale_mode)
    q = _mul_pow2(torch.where(neg, -r, r), s.unsqueeze(-1))
    q = torch.where(nan.unsqueeze(-1), float("nan"), q)
    return in_dtype(q.reshape(x.shape), x.dtype)  # no no-op .to: see in_dtype (what _FakeQuantSTE returns)


def mx_round_trip(x: torch.Tensor, fmt: str, block_size: int = 32, scale_mode: str = "floor",
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """dequantize_mx(quantize_mx(x)) in x's dtype, without building the codes (bit-identical to it). Computed over
    whole rows of the last dimension, at most ROUND_TRIP_CHUNK elements at a time (the blocks run along it, so a
    chunk's values are the whole tensor's). `out`: a contiguous tensor of x's shape and dtype to write to; x itself
    (contiguous) quantises in place."""
    f = elem_format(fmt)
    _check(x, block_size, scale_mode)
    n = x.shape[-1]
    step = max(1, ROUND_TRIP_CHUNK // n)
    rows = x.reshape(-1, n)
    if rows.shape[0] <= step and out is None:
        return _round_trip_rows(x, f, block_size, scale_mode)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    dst = out.view(-1, n)
    for i in range(0, rows.shape[0], step):
        dst[i:i + step] = _round_trip_rows(rows[i:i + step], f, block_size, scale_mode)
    return out


class _FakeQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmt, block_size, scale_mode):
        return mx_round_trip(x, fmt, block_size, scale_mode)

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None  # straight-through: d q / d x = 1


def fake_quant_mx(x: torch.Tensor, fmt: str, block_size: int = 32, scale_mode: str = "floor") -> torch.Tensor:
    """x quantised to MX and back, in x's dtype, with a straight-through gradient. Idempotent."""
    return _FakeQuantSTE.apply(x, fmt, block_size, scale_mode)


# ---------------------------------------------------------------------------------------------- packing
def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes uint8 [..., 2n] -> bytes [..., n]: the even column in the low nibble (K3 / OCP layout)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: the last dimension {codes.shape[-1]} must be even")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., n] -> E2M1 codes uint8 [..., 2n] (low nibble first)."""
    p = packed.to(torch.uint8)
    return torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


__all__ = ["quantize_mx", "dequantize_mx", "fake_quant_mx", "mx_round_trip", "pack_e2m1", "unpack_e2m1",
           "encode_at_scales", "elem_values", "elem_format", "FORMATS", "SCALE_MODES", "E8M0_BIAS", "E8M0_NAN"]
