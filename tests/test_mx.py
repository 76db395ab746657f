"""ops.mx: bit-identical to torchao's MX cast (codes and E8M0 scales, both scale modes), the OCP MX spec on the
edge cases where torchao departs from it, a brute-force rounding reference, and the properties QAT relies on
(idempotence, the stated error bound, the straight-through gradient, the K3 packing)."""

import ast
from pathlib import Path

import pytest
import torch

from megatron_k3.ops.mx import (
    FORMATS,
    dequantize_mx,
    elem_values,
    fake_quant_mx,
    mx_round_trip,
    pack_e2m1,
    quantize_mx,
    unpack_e2m1,
)

FMTS = ("e2m1", "e4m3", "e5m2")
MODES = ("floor", "rceil")
MAXN = {"e2m1": 6.0, "e4m3": 448.0, "e5m2": 57344.0}
EMAX = {"e2m1": 2, "e4m3": 8, "e5m2": 15}
MBITS = {"e2m1": 1, "e4m3": 3, "e5m2": 2}


def torchao_cast(x, fmt, mode):
    """torchao's MX cast as raw bits: (element data uint8, E2M1 packed two per byte as torchao stores it;
    scales uint8 from float8_e8m0fnu)."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    cm = pytest.importorskip("torchao.prototype.mx_formats.config")
    dt = {"e2m1": torch.float4_e2m1fn_x2, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    t = mx.MXTensor.to_mx(x.contiguous(), dt, block_size=32, scaling_mode=getattr(cm.ScaleCalculationMode,
                                                                                  mode.upper()))
    return t.qdata.view(torch.uint8), t.scale.view(torch.uint8)


def ours_bits(x, fmt, mode):
    codes, scales = quantize_mx(x, fmt, scale_mode=mode)
    return (pack_e2m1(codes) if fmt == "e2m1" else codes), scales


def random_blocks(lg, dtype, seed):
    """[16, 256] values around 2^lg: per-block magnitudes spread over 2^-8..2^8, a third of the rows pushed
    2^-12 down (so blocks mix large and underflowing elements)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 256, generator=g) * 2.0 ** lg
    x = x * torch.exp2(torch.randint(-8, 9, (16, 8, 1), generator=g).float()).repeat_interleave(32, -1).view(16, 256)
    x[:, ::3] *= 2.0 ** -12
    return x.to(dtype)


def block(*vals):
    x = torch.zeros(32)
    x[:len(vals)] = torch.tensor(vals, dtype=torch.float32)
    return x


# ------------------------------------------------------------------------------------------- torchao, bit for bit
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("mode", MODES)
def test_matches_torchao_random(fmt, mode):
    for i, lg in enumerate((-100, -60, -20, -3, 0, 3, 20, 60, 110)):
        for dtype in (torch.float32, torch.bfloat16):
            x = random_blocks(lg, dtype, seed=i)
            ref, ours = torchao_cast(x, fmt, mode), ours_bits(x, fmt, mode)
            assert torch.equal(ours[1], ref[1]), (lg, dtype, "scales")
            assert torch.equal(ours[0], ref[0]), (lg, dtype, "codes")


EDGE_BLOCKS = {
    "all_zero": block(),
    "signed_zeros": block(-0.0, 4.0, -0.0, 0.0),
    "powers_of_two": block(2.0 ** -3, 2.0 ** 5, -2.0 ** 5, 1.0, 2.0 ** -20),
    # amax 4 -> X = 1 (floor) for E2M1; every E2M1 midpoint and its negative
    "e2m1_midpoints": block(4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0),
    "e2m1_saturation": block(7.9, -7.9, 6.5, 7.0, 1.0),
    # amax 256 -> X = 1 for E4M3: subnormals 2^-9.., their midpoints and ties
    "e4m3_subnormals": block(256.0, 2.0 ** -7, 1.5 * 2.0 ** -8, 2.0 ** -10, 3 * 2.0 ** -10, -2.0 ** -10,
                             1.4 * 2.0 ** -9, 5 * 2.0 ** -10, 7 * 2.0 ** -10, 2.0 ** -6 - 2.0 ** -10),
    "e4m3_saturation": block(1.9 * 256, 464.0, 470.0, -500.0, 448.0, 456.0),
    "e4m3_midpoints": block(256.0, 1.0625, 1.1875, 17.0, 19.0, 272.0, 304.0, -1.0625),
    # amax 32768 -> X = 1 for E5M2: subnormals 2^-16.. and saturation
    "e5m2_range": block(32768.0, 2.0 ** -16, 3 * 2.0 ** -17, 2.0 ** -17, 61440.0, 65000.0, -60000.0, 1.125, 1.375),
    "max_normals": block(6.0, 448.0, 57344.0, -57344.0),
    "huge": block(3e38, 1e38, -2e38, 1.0),
    "tiny_normal": block(2.0 ** -100, 2.0 ** -101, -3 * 2.0 ** -103),
    "rceil_boundary": block(6.0, 448.0 * 2, 57344.0 * 4),
}


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("mode", MODES)
def test_matches_torchao_edge_cases(fmt, mode):
    x = torch.stack(list(EDGE_BLOCKS.values()))
    ref, ours = torchao_cast(x, fmt, mode), ours_bits(x, fmt, mode)
    for i, name in enumerate(EDGE_BLOCKS):
        assert torch.equal(ours[1][i], ref[1][i]), (name, "scale")
        assert torch.equal(ours[0][i], ref[0][i]), (name, "codes")


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("mode", MODES)
def test_nan_blocks_match_torchao_scale(fmt, mode):
    """A NaN makes the block's scale NaN (0xFF) in both; the element codes of a NaN-scale block carry no
    information (we write the NaN code, 0 for E2M1; torchao leaves other values), and the block decodes to NaN."""
    x = torch.stack([block(float("nan"), 1.0, -2.0), block(1.0, 2.0)])
    ref, ours = torchao_cast(x, fmt, mode), ours_bits(x, fmt, mode)
    assert torch.equal(ours[1], ref[1]) and ours[1][0, 0] == 255
    assert torch.equal(ours[0][1], ref[0][1])
    codes, scales = quantize_mx(x, fmt, scale_mode=mode)
    d = dequantize_mx(codes, scales, fmt)
    assert torch.isnan(d[0]).all() and not torch.isnan(d[1]).any()


def test_rceil_inf_matches_torchao():
    """rceil follows the hardware's satfinite conversion: Inf -> scale 2^127 (0xFE), element +-max normal."""
    x = torch.stack([block(float("inf"), 1.0, -3.0), block(-float("inf"), 2.0)])
    for fmt in FMTS:
        ref, ours = torchao_cast(x, fmt, "rceil"), ours_bits(x, fmt, "rceil")
        assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
        codes, scales = quantize_mx(x, fmt, scale_mode="rceil")
        assert (scales == 254).all()
        d = dequantize_mx(codes, scales, fmt)
        assert d[0, 0] == MAXN[fmt] * 2.0 ** 127 or torch.isinf(d[0, 0])  # E5M2's 57344 * 2^127 overflows fp32


# ------------------------------------------------------------------------------------------- where we follow the spec
def test_floor_inf_gives_nan_scale_as_the_spec():
    """floor: floor(log2 Inf) - emax overflows E8M0 (which has no Inf) and E2M1/E4M3 hold no Inf, so the block is
    NaN (microsoft/microxcaling, the spec authors' reference, does the same). torchao instead saturates the
    scale to 2^(128 - emax) and the Inf to max normal."""
    x = torch.stack([block(float("inf"), 1.0), block(-float("inf"), 2.0), block(1.0, 2.0)])
    for fmt in FMTS:
        codes, scales = quantize_mx(x, fmt)
        assert scales.tolist() == [[255], [255], [127 + 1 - EMAX[fmt]]]
        d = dequantize_mx(codes, scales, fmt)
        assert torch.isnan(d[:2]).all() and torch.equal(d[2], x[2])


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("mode", MODES)
def test_scale_underflow_follows_the_spec(fmt, mode):
    """Blocks whose scale is E8M0's minimum 2^-127 (code 0): P = V / 2^-127 as the spec says. torchao divides by
    2^-126 there (floor) or by 1 (rceil, after TransformerEngine), so its codes differ from ours on such blocks;
    with exactly representable values ours round-trips exactly."""
    grid = elem_values(fmt)[: (1 << (FORMATS[fmt].bits - 1))]
    grid = grid[torch.isfinite(grid)]
    vals = grid[torch.randperm(len(grid), generator=torch.Generator().manual_seed(0))][:32]
    vals[0] = MAXN[fmt] if mode == "rceil" else 2.0 ** EMAX[fmt]  # pins X to 2^-127 below
    x = torch.zeros(32)
    x[: len(vals)] = vals
    x = x * 2.0 ** -127
    x[1::2] *= -1
    codes, scales = quantize_mx(x.view(1, 32), fmt, scale_mode=mode)
    assert scales.item() == 0
    assert torch.equal(dequantize_mx(codes, scales, fmt).view(32), x)


def test_rceil_is_the_exact_ceiling():
    """rceil: X = 2^ceil(log2(amax / max)) exactly (PTX cvt.rp to UE8M0). torchao's eager fallback takes
    ceil(log2(.)) in fp32, which rounds log2 of a quotient one or two ulps above 2^k down to k for |k| >= 4
    and picks a scale one too small (the top element then saturates); we do not."""
    rows, want = [], []
    for fmt in FMTS:
        for k in (-40, -9, -3, 0, 3, 9, 40):
            base = torch.tensor(MAXN[fmt] * 2.0 ** k)
            for j in (-2, -1, 0, 1, 2, 3):
                amax = (base.view(torch.int32) + j).view(torch.float32)
                x = block(float(amax), 1e-30 * float(amax)).view(1, 32)
                codes, scales = quantize_mx(x, fmt, scale_mode="rceil")
                q = amax.double() / MAXN[fmt]  # exact enough: fp32 / fp32 in fp64 decides every case here
                e = int(torch.ceil(torch.log2(q)).item()) if j != 0 else k
                rows.append(scales.item() - 127)
                want.append(e)
                d = dequantize_mx(codes, scales, fmt)
                assert abs(float(d[0, 0]) - float(amax)) <= float(amax) * 2.0 ** -(MBITS[fmt] + 1)  # never clipped
    assert rows == want


# ------------------------------------------------------------------------------------------- a brute-force reference
def reference_round(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """Nearest grid value of every y (|y| beyond max normal saturates), ties to the even code, by brute force."""
    v = elem_values(fmt)[: 1 << (FORMATS[fmt].bits - 1)].double()  # non-negative codes
    ok = torch.isfinite(v)
    v, codes = v[ok], torch.arange(len(ok))[ok]
    a = y.abs().double().clamp(max=MAXN[fmt]).unsqueeze(-1)
    dist = (a - v).abs()
    best = dist.min(-1, keepdim=True).values
    cand = dist == best
    even = cand & (codes % 2 == 0)
    pick = torch.where(even.any(-1, keepdim=True), even, cand).double().argmax(-1)
    return (v[pick] * torch.where(torch.signbit(y), -1.0, 1.0)).float()


@pytest.mark.parametrize("fmt", FMTS)
def test_element_rounding_matches_brute_force(fmt):
    """With X pinned to 1 (a 2^emax anchor in each block, floor mode), every grid value, every midpoint, points
    a hair either side of them, and the saturation range round as the brute-force reference says."""
    v = elem_values(fmt)[: 1 << (FORMATS[fmt].bits - 1)]
    v = v[torch.isfinite(v)].sort().values
    mids = (v[1:] + v[:-1]) / 2
    pts = torch.cat([v, mids, mids * (1 + 2.0 ** -20), mids * (1 - 2.0 ** -20),
                     torch.linspace(float(v[-1]), 2.0 ** (EMAX[fmt] + 1) * 0.999, 40)])
    pts = torch.cat([pts, -pts])
    n = 31 * ((len(pts) + 30) // 31)
    pts = torch.cat([pts, torch.zeros(n - len(pts))]).view(-1, 31)
    x = torch.cat([torch.full((pts.shape[0], 1), 2.0 ** EMAX[fmt]), pts], 1)
    codes, scales = quantize_mx(x, fmt)
    assert (scales == 127).all()
    assert torch.equal(dequantize_mx(codes, scales, fmt)[:, 1:], reference_round(pts, fmt))
    if fmt != "e2m1":  # and the codes are torch's own saturating float8 casts of the same values
        dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
        assert torch.equal(codes[:, 1:], pts.clamp(-MAXN[fmt], MAXN[fmt]).to(dt).view(torch.uint8))


def test_decoding_tables():
    assert elem_values("e2m1").tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    for fmt, dt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        t = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt).float()
        lut = elem_values(fmt)
        assert torch.equal(torch.isnan(lut), torch.isnan(t))
        assert torch.equal(lut[~torch.isnan(t)], t[~torch.isnan(t)])


# ------------------------------------------------------------------------------------------- properties QAT needs
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("mode", MODES)
def test_idempotent_and_round_trip(fmt, mode):
    x = torch.cat([random_blocks(lg, torch.float32, seed=10 + i) for i, lg in enumerate((-30, 0, 30))])
    x[0, :32] = 0.0
    x[1, 5] = float("nan")
    q = fake_quant_mx(x, fmt, scale_mode=mode)
    codes, scales = quantize_mx(x, fmt, scale_mode=mode)
    d = dequantize_mx(codes, scales, fmt)
    assert torch.equal(q.view(torch.int32), d.view(torch.int32))  # same bits, NaNs included
    assert torch.equal(mx_round_trip(x, fmt, scale_mode=mode).view(torch.int32), q.view(torch.int32))
    finite = torch.isfinite(q)
    q2 = fake_quant_mx(q, fmt, scale_mode=mode)
    assert torch.equal(q2[finite], q[finite]) and torch.isnan(q2[~finite]).all()
    if mode == "floor":  # the scale and codes themselves are reproduced (what export relies on)
        c2, s2 = quantize_mx(d, fmt, scale_mode=mode)
        assert torch.equal(s2, scales) and torch.equal(c2, codes)
    xb = x.bfloat16()
    qb = fake_quant_mx(xb, fmt, scale_mode=mode)
    assert qb.dtype == torch.bfloat16 and torch.equal(fake_quant_mx(qb, fmt, scale_mode=mode)[finite], qb[finite])


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("mode", MODES)
def test_error_bound(fmt, mode):
    """The bound stated in ops/mx.py, per block with E = floor(log2 amax), X the block scale, m mantissa bits."""
    x = torch.cat([random_blocks(lg, torch.float32, seed=20 + i) for i, lg in enumerate((-40, 0, 40))])
    codes, scales = quantize_mx(x, fmt, scale_mode=mode)
    q = dequantize_mx(codes, scales, fmt).double().view(x.shape[0], -1, 32)
    xb = x.double().view(x.shape[0], -1, 32)
    X = torch.exp2(scales.double() - 127).unsqueeze(-1)
    E = torch.floor(torch.log2(xb.abs().amax(-1, keepdim=True)))
    err, m = (xb - q).abs(), MBITS[fmt]
    sat = xb.abs() > MAXN[fmt] * X
    if mode == "floor":
        assert torch.equal(X, torch.exp2(E - EMAX[fmt]))
        assert (err <= torch.exp2(E - m - 1))[~sat].all()
        assert (err < torch.exp2(E + 1) - MAXN[fmt] * X)[sat].all()
        assert (err <= torch.exp2(E - (1 if fmt == "e2m1" else 2)))[sat].all()
    else:
        assert not sat.any() and (err <= torch.exp2(E - m)).all()
    normal = xb.abs() >= 2.0 ** (1 - FORMATS[fmt].bias) * X  # in the element's normal range
    assert (err <= xb.abs() * 2.0 ** -(m + 1))[normal & ~sat].all()


def test_straight_through_gradient_and_dtypes():
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = (torch.randn(4, 64) * 3).to(dtype).requires_grad_()
        g = torch.randn(4, 64).to(dtype)
        y = fake_quant_mx(x, "e2m1")
        assert y.dtype == dtype
        y.backward(g)
        assert torch.equal(x.grad, g)


def test_block_layout_along_last_dim():
    x = torch.randn(3, 2, 96)
    codes, scales = quantize_mx(x, "e4m3")
    assert codes.shape == x.shape and scales.shape == (3, 2, 3) and codes.dtype == scales.dtype == torch.uint8
    c2, s2 = quantize_mx(x[1, 1, 32:64].contiguous(), "e4m3")
    assert torch.equal(c2, codes[1, 1, 32:64]) and s2.item() == scales[1, 1, 1]
    assert torch.equal(quantize_mx(x.transpose(0, 1), "e4m3")[0], codes.transpose(0, 1))  # strided input


def test_pack_e2m1_layout():
    codes = torch.tensor([[1, 2, 15, 0, 8, 7]], dtype=torch.uint8)
    assert pack_e2m1(codes).tolist() == [[0x21, 0x0F, 0x78]]  # even column in the low nibble
    allb = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16)
    assert torch.equal(pack_e2m1(unpack_e2m1(allb)), allb)
    assert unpack_e2m1(torch.tensor([0xA3], dtype=torch.uint8)).tolist() == [3, 10]
    with pytest.raises(ValueError):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))


def test_invalid_arguments():
    with pytest.raises(ValueError, match="multiple of block_size"):
        quantize_mx(torch.randn(2, 48), "e4m3")
    with pytest.raises(ValueError, match="unknown MX element format"):
        quantize_mx(torch.randn(2, 32), "e3m4")
    with pytest.raises(ValueError, match="scale_mode"):
        quantize_mx(torch.randn(2, 32), "e4m3", scale_mode="even")
    with pytest.raises(ValueError, match="scales shape"):
        dequantize_mx(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), "e4m3")


def test_ops_module_imports_nothing_of_ours_but_the_dtype_rules():
    """ops/mx.py is plain torch: of ours it takes only ops.numerics (torch alone), for in_dtype."""
    src = Path(__file__).resolve().parent.parent / "megatron_k3" / "ops" / "mx.py"
    mods = set()
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mods.add("." * node.level + (node.module or "") if node.level else node.module.split(".")[0])
    assert mods <= {"__future__", "math", "dataclasses", "torch", ".numerics"}, mods


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_round_trip_in_chunks_is_the_whole_and_bounds_its_temporaries(monkeypatch, dtype, mode):
    """mx_round_trip quantises whole rows of the last dim, ROUND_TRIP_CHUNK elements at a time: the same bits as in
    one piece (NaN blocks included), out of place and in place, and the temporaries are a chunk's (at most
    ROUND_TRIP_BYTES_PER_ELEMENT per element of a chunk beside the input and the output): a K3 rank's 14 experts'
    [w1; w3] (310M elements) took 14 GB of temporaries in one piece."""
    from megatron_k3.ops import mx
    from megatron_k3.planning.measure import LiveTensorMemory

    x = torch.cat([random_blocks(lg, torch.float32, seed=20 + i) for i, lg in enumerate((-20, 0, 20))] * 12)
    x = x.reshape(-1, 64 * 3).to(dtype)  # rows of 6 blocks
    x[3, 40] = float("nan")
    whole = mx._round_trip_rows(x, mx.elem_format("e2m1"), 32, mode)
    monkeypatch.setattr(mx, "ROUND_TRIP_CHUNK", 7 * x.shape[-1] + 5)  # 7 rows a chunk; the last chunk shorter
    assert x.shape[0] % 7
    assert torch.equal(mx_round_trip(x, "e2m1", scale_mode=mode).view(torch.uint8), whole.view(torch.uint8))
    y = x.clone()
    assert mx_round_trip(y, "e2m1", scale_mode=mode, out=y) is y
    assert torch.equal(y.view(torch.uint8), whole.view(torch.uint8))
    chunk = 7 * x.shape[-1]
    mem = LiveTensorMemory()
    with mem:
        mx_round_trip(x, "e2m1", scale_mode=mode)
    # the input (seen through its row view) and the output are whole; the rest is one chunk's
    assert mem.peak - 2 * x.numel() * x.element_size() <= chunk * mx.ROUND_TRIP_BYTES_PER_ELEMENT
    assert mem.peak > 2 * chunk * 4  # the bound is not vacuous: the temporaries are several fp32 per element
