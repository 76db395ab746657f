"""Routed experts frozen in MXFP4 (ops.frozen_experts, issue 35's base): the packed encoding is the release's
(interop.k3_experts' independent encoder and decoder agree byte for byte), 17 bytes per 32 parameters; the
block-decoded forward and its input gradient equal the plain per-expert reference over the decoded weights (float64
autograd) to fp32 rounding, whatever the block, and never decode more than `block` experts at a time."""

from __future__ import annotations

import pytest
import torch

from megatron_k3.interop.k3_experts import dequantize_k3_weight, quantize_k3_weight
from megatron_k3.ops.frozen_experts import (
    ExpertAdapters,
    PackedExperts,
    frozen_experts_batched,
    frozen_experts_grouped,
)
from megatron_k3.ops.grouped_gemm import experts_reference

E, C, L, I = 5, 6, 64, 96


def _experts(seed=0):
    g = torch.Generator().manual_seed(seed)
    w1, w3 = (torch.randn(E, I, L, generator=g) * 0.1 for _ in range(2))
    w2 = torch.randn(E, L, I, generator=g) * 0.1
    return [PackedExperts.encode(w) for w in (w1, w3, w2)], torch.randn(E, C, L, generator=g)


def test_the_encoding_is_the_releases_and_costs_17_bytes_per_32_parameters():
    (w1, _, _), _ = _experts()
    for e in range(E):
        packed, scale = quantize_k3_weight(w1.decode(e, e + 1)[0])
        assert torch.equal(packed.view(torch.uint8), w1.packed[e]) and torch.equal(scale.view(torch.uint8), w1.scale[e])
        assert torch.equal(dequantize_k3_weight(w1.packed[e], w1.scale[e]), w1.decode(e, e + 1)[0])
    # from the format's definition: two E2M1 codes a byte, the even column low; bit 3 the sign; 2^(scale - 127)
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    codes = torch.stack([w1.packed & 0xF, w1.packed >> 4], -1).reshape(E, I, L).long()
    by_hand = e2m1[codes & 7] * (1 - 2 * (codes >> 3)) * torch.exp2(w1.scale.double() - 127).repeat_interleave(32, -1)
    assert torch.equal(by_hand, w1.decode(dtype=torch.float64))
    assert w1.nbytes / (E * I * L) == 17 / 32
    assert torch.equal(w1.decode(dtype=torch.bfloat16).float(), w1.decode())  # exact in bf16


class _Counting(PackedExperts):
    def decode(self, start=0, stop=None, dtype=torch.float32):
        _Counting.widest = max(_Counting.widest, (self.num_experts if stop is None else stop) - start)
        return super().decode(start, stop, dtype)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: with two, MKL's batched GEMM splits a batch of one expert differently
    from a batch of five (torch.bmm on a 2-core AVX-512 EPYC, 2026-12-06: 5.7e-6 apart in fp32), so the blocks'
    bit-identity holds per thread count, not across them; make test runs one thread per worker."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_block_decoded_experts_equal_the_reference_and_decode_only_a_block(act, one_thread):
    (w1, w3, w2), x = _experts(1)
    expert = torch.arange(E).repeat_interleave(C)
    x64 = x.double().reshape(E * C, L).requires_grad_(True)
    ref = experts_reference(x64, expert, *(w.decode(dtype=torch.float64) for w in (w1, w3, w2)), act)
    dy = torch.randn_like(ref)
    (ref * dy).sum().backward()
    outs = []
    for block in (1, 2, E):
        _Counting.widest = 0
        xb = x.clone().requires_grad_(True)
        y = frozen_experts_batched(xb, *(_Counting(w.packed, w.scale) for w in (w1, w3, w2)), act, block=block)
        (y * dy.float().reshape(E, C, L)).sum().backward()
        assert _Counting.widest == block
        err = (y.double().reshape(E * C, L) - ref).norm() / ref.norm()
        gerr = (xb.grad.double().reshape(E * C, L) - x64.grad).norm() / x64.grad.norm()
        assert err < 1e-6 and gerr < 1e-6, (block, err, gerr)  # fp32 against float64: rounding only
        outs.append((y.detach(), xb.grad))
    for y, g in outs[1:]:  # per-expert GEMMs: the block changes no number
        assert torch.equal(y, outs[0][0]) and torch.equal(g, outs[0][1])


R = 3


def _adapters(seed, zero_b=False, dtype=torch.float32, rank=R):
    g = torch.Generator().manual_seed(seed)
    shapes = [(E, rank, L), (E, I, rank), (E, rank, L), (E, I, rank), (E, rank, I), (E, L, rank)]
    ts = [torch.randn(*sh, generator=g, dtype=dtype) * 0.1 for sh in shapes]
    if zero_b:
        ts[1::2] = [torch.zeros_like(t) for t in ts[1::2]]
    return [t.requires_grad_(True) for t in ts]


@pytest.mark.parametrize("block", [2, E])
def test_adapters_equal_the_merged_reference_and_take_the_gradients(block):
    """Per-expert LoRA terms beside the frozen matrices: the output and the gradients of x, every A and every B equal
    float64 autograd through the merged weights w + scale * B A (rank 3, scale 2) to fp32 rounding; with B = 0 the
    output is bit-identical to the frozen experts alone."""
    (w1, w3, w2), x = _experts(2)
    scale = 2.0
    ab = _adapters(3)
    xb = x.clone().requires_grad_(True)
    y = frozen_experts_batched(xb, w1, w3, w2, "situ", block=block, adapters=ExpertAdapters(*ab, scale))
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
    (y * dy).sum().backward()
    ab64 = [t.detach().double().requires_grad_(True) for t in ab]
    x64 = x.double().reshape(E * C, L).requires_grad_(True)
    merged = [w.decode(dtype=torch.float64) + scale * torch.bmm(b, a)
              for w, a, b in zip((w1, w3, w2), ab64[0::2], ab64[1::2])]
    ref = experts_reference(x64, torch.arange(E).repeat_interleave(C), *merged, "situ")
    (ref * dy.double().reshape(E * C, L)).sum().backward()
    for name, got, want in [("y", y, ref), ("x", xb.grad, x64.grad)] + [
            (n, t.grad, t64.grad) for n, t, t64 in zip(("a1", "b1", "a3", "b3", "a2", "b2"), ab, ab64)]:
        got, want = got.double().reshape(want.shape), want.detach()
        assert (got - want).norm() / want.norm() < 1e-6, (name, block)
    zero = _adapters(5, zero_b=True)
    with torch.no_grad():
        base = frozen_experts_batched(x, w1, w3, w2, "situ", block=block)
        assert torch.equal(frozen_experts_batched(x, w1, w3, w2, "situ", block=block,
                                                  adapters=ExpertAdapters(*zero, scale)), base)


@pytest.mark.parametrize("block,rank", [(1, 4), (2, 4), (E, 4), (2, 3)])
def test_grouped_rows_with_an_empty_expert_equal_the_reference(block, rank):
    """The dropless path: expert-sorted rows of uneven counts (expert 2 has none), grouped GEMMs per block of
    experts (rank 3 in fp32: rows not 16-byte aligned for the native grouped GEMM, a per-expert loop instead),
    adapters on: output and every gradient against float64 autograd through the merged weights."""
    (w1, w3, w2), _ = _experts(6)
    counts = torch.tensor([3, 1, 0, 4, 2])
    expert = torch.arange(E).repeat_interleave(counts)
    gen = torch.Generator().manual_seed(7)
    z = torch.randn(int(counts.sum()), L, generator=gen)
    scale, ab = 0.5, _adapters(8, rank=rank)
    zb = z.clone().requires_grad_(True)
    y = frozen_experts_grouped(zb, counts.cumsum(0), w1, w3, w2, "situ", block=block,
                               adapters=ExpertAdapters(*ab, scale))
    dy = torch.randn(y.shape, generator=gen)
    (y * dy).sum().backward()
    ab64 = [t.detach().double().requires_grad_(True) for t in ab]
    z64 = z.double().requires_grad_(True)
    merged = [w.decode(dtype=torch.float64) + scale * torch.bmm(b, a)
              for w, a, b in zip((w1, w3, w2), ab64[0::2], ab64[1::2])]
    ref = experts_reference(z64, expert, *merged, "situ")
    (ref * dy.double()).sum().backward()
    for name, got, want in [("y", y, ref), ("z", zb.grad, z64.grad)] + [
            (n, t.grad, t64.grad) for n, t, t64 in zip(("a1", "b1", "a3", "b3", "a2", "b2"), ab, ab64)]:
        got, want = got.double().reshape(want.shape), want.detach()
        assert (got - want).norm() / want.norm() < 1e-6, (name, block)
    assert ab[0].grad[2].abs().sum() == 0 and ab[5].grad[2].abs().sum() == 0  # no rows, no gradient


def test_bad_shapes_are_named():
    (w1, w3, w2), x = _experts()
    with pytest.raises(ValueError, match="expected w1/w3"):
        frozen_experts_batched(x[:, :, :32], w1, w3, w2, "situ")
    with pytest.raises(ValueError, match="block=0"):
        frozen_experts_batched(x, w1, w3, w2, "situ", block=0)
    with pytest.raises(ValueError, match=r"ExpertAdapters.b2: shape \(5, 64, 2\), expected \(5, 64, 3\)"):
        ab = _adapters(0)
        ab[5] = ab[5][:, :, :2]
        frozen_experts_batched(x, w1, w3, w2, "situ", adapters=ExpertAdapters(*ab, 1.0))
    with pytest.raises(ValueError, match="not uint8"):
        PackedExperts(w1.packed.float(), w1.scale)
