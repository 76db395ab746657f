"""The hand-written autograd Functions of the MoE layer against autograd of the plain formulas: the GLU
(ops.glu.GLU), the fused gate/up GEMM + GLU of the routed experts (ops.grouped_gemm.GateUpGLU) and the down
projection fused with the weighted combine (ops.grouped_gemm.DownCombine). float64 gradcheck, fp32 equality to
rounding, bf16 dtypes."""

import pytest
import torch
from helpers import max_abs_rel

from megatron_k3.model.experts import GroupedExperts
from megatron_k3.ops.glu import glu_act, glu_reference
from megatron_k3.ops.grouped_gemm import DownCombine, GateUpGLU

ACTS = ["silu", "situ"]


@pytest.mark.parametrize("act", ACTS)
def test_glu_gradcheck_float64(act):
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(7, 5, generator=g, dtype=torch.float64) * 4).requires_grad_()
    up = (torch.randn(7, 5, generator=g, dtype=torch.float64) * 30).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: glu_act(a, b, act, 4.0, 25.0), (gate, up))
    # strided halves of one tensor, as the fused experts pass them
    gu = (torch.randn(7, 10, generator=g, dtype=torch.float64) * 4).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: glu_act(t[:, :5], t[:, 5:], act, 2.0, 3.0), (gu,))


@pytest.mark.parametrize("act", ACTS)
def test_glu_fp32_equals_plain_formula(act):
    g = torch.Generator().manual_seed(1)
    gu = (torch.randn(300, 64, generator=g) * 3).requires_grad_()
    dh = torch.randn(300, 32, generator=g)
    outs = []
    for fn in (glu_act, glu_reference):
        h = fn(gu[:, :32], gu[:, 32:], act)
        (d,) = torch.autograd.grad(h, gu, dh)
        outs.append((h, d))
    (h, d), (h_ref, d_ref) = outs
    assert h.dtype == torch.float32 and max_abs_rel(h, h_ref) < 1e-6 and max_abs_rel(d, d_ref) < 1e-6


@pytest.mark.parametrize("act", ACTS)
def test_glu_bf16_keeps_dtypes_and_computes_in_fp32(act):
    g = torch.Generator().manual_seed(2)
    gate = (torch.randn(200, 16, generator=g) * 3).bfloat16().requires_grad_()
    up = (torch.randn(200, 16, generator=g) * 3).bfloat16().requires_grad_()
    dh = torch.randn(200, 16, generator=g).bfloat16()
    h = glu_act(gate, up, act)
    dg, du = torch.autograd.grad(h, (gate, up), dh)
    assert h.dtype == dg.dtype == du.dtype == torch.bfloat16
    h_ref = glu_reference(gate, up, act)
    dg_ref, du_ref = torch.autograd.grad(h_ref, (gate, up), dh)
    # both compute in fp32 and round once to bf16: equal up to one bf16 rounding step (2^-8 relative)
    assert max_abs_rel(h, h_ref) < 2 ** -8 and max_abs_rel(dg, dg_ref) < 2 ** -8 and max_abs_rel(du, du_ref) < 2 ** -8


def _grouped(E, L, I, counts, dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    w1, w3 = (torch.randn(E, I, L, generator=g, dtype=dtype) * L ** -0.5 for _ in range(2))
    w2 = torch.randn(E, L, I, generator=g, dtype=dtype) * I ** -0.5
    x = torch.randn(int(sum(counts)), L, generator=g, dtype=dtype)
    return x, w1, w3, w2, torch.cumsum(torch.tensor(counts), 0)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("batched", [False, True], ids=["grouped", "batched"])
def test_gate_up_glu_gradcheck_float64(act, batched):
    counts = [3, 3, 3] if batched else [2, 0, 4]  # an expert without rows in the grouped case
    x, w1, w3, _, offs = _grouped(3, 4, 5, counts, torch.float64)
    if batched:
        x, offs = x.view(3, 3, 4), None
    args = [t.requires_grad_() for t in (x, w1, w3)]
    assert torch.autograd.gradcheck(lambda a, b, c: GateUpGLU.apply(a, b, c, offs, act, 2.0, 3.0), args)


@pytest.mark.parametrize("batched", [False, True], ids=["grouped", "batched"])
def test_down_combine_gradcheck_float64(batched):
    counts = [3, 3, 3] if batched else [2, 0, 4, 3]
    E = len(counts)
    g = torch.Generator().manual_seed(4)
    h = torch.randn(sum(counts), 5, generator=g, dtype=torch.float64)
    w2 = torch.randn(E, 4, 5, generator=g, dtype=torch.float64)
    w_M = torch.rand(sum(counts), generator=g, dtype=torch.float64)
    w_M[1] = 0.0  # an empty slot of the drop path
    tok_M = torch.randint(0, 4, (sum(counts),), generator=g)  # several rows per output row
    offs = None if batched else torch.cumsum(torch.tensor(counts), 0)
    if batched:
        h = h.view(E, 3, 5)
    args = [t.requires_grad_() for t in (h, w2, w_M)]
    assert torch.autograd.gradcheck(lambda a, b, c: DownCombine.apply(a, b, offs, c, tok_M, 4), args)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("batched", [False, True], ids=["grouped", "batched"])
def test_fused_experts_fp32_equal_per_expert_reference(act, batched):
    """GroupedExperts with the fused combine == per-expert plain autograd (forward_reference), outputs and every
    gradient to fp32 rounding."""
    E, L, I, N = 6, 32, 24, 40
    counts = [20] * E if batched else [25, 0, 31, 18, 26, 20]
    torch.manual_seed(5)
    ex = GroupedExperts(E, L, I, act)
    for w in ex.parameters():
        torch.nn.init.normal_(w, std=0.3)
    M = sum(counts)
    expert_M = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    z = torch.randn(M, L, requires_grad=True)
    w_M = torch.rand(M, requires_grad=True)
    tok_M = torch.randint(0, N, (M,))
    dr = torch.randn(N, L)
    if batched:
        r = ex.forward_batched(z.view(E, -1, L), combine=(w_M, tok_M, N))
    else:
        r = ex(z, torch.cumsum(torch.tensor(counts), 0), combine=(w_M, tok_M, N))
    grads = torch.autograd.grad(r, (z, w_M, ex.w1, ex.w3, ex.w2), dr)
    y = ex.forward_reference(z, expert_M)
    r_ref = torch.zeros(N, L).index_add(0, tok_M, y * w_M[:, None])
    grads_ref = torch.autograd.grad(r_ref, (z, w_M, ex.w1, ex.w3, ex.w2), dr)
    assert r.dtype == torch.float32 and max_abs_rel(r, r_ref) < 1e-5
    for a, b in zip(grads, grads_ref):
        assert a.shape == b.shape and a.is_contiguous() and max_abs_rel(a, b) < 1e-5


@pytest.mark.parametrize("act", ACTS)
def test_fused_experts_bf16_combine_in_fp32(act):
    """bf16 rows: the combine comes back in fp32 (late weights applied and summed in fp32), parameter gradients
    in the parameters' fp32, and the routing-weight gradient uses the bf16 expert output as the plain path."""
    E, L, I, N = 4, 32, 16, 30
    counts = [15, 10, 20, 15]
    torch.manual_seed(6)
    ex = GroupedExperts(E, L, I, act)
    for w in ex.parameters():
        torch.nn.init.normal_(w, std=0.3)
    offs = torch.cumsum(torch.tensor(counts), 0)
    z = torch.randn(sum(counts), L).bfloat16().requires_grad_()
    w_M = torch.rand(sum(counts), requires_grad=True)
    tok_M = torch.randint(0, N, (sum(counts),))
    r = ex(z, offs, combine=(w_M, tok_M, N))
    assert r.dtype == torch.float32
    dr = torch.randn(N, L)
    grads = torch.autograd.grad(r, (z, w_M, ex.w1, ex.w3, ex.w2), dr)
    assert [g.dtype for g in grads] == [torch.bfloat16] + [torch.float32] * 4
    y = ex(z, offs)  # unfused down projection, plain autograd combine
    r_ref = torch.zeros(N, L).index_add(0, tok_M, y.float() * w_M[:, None])
    grads_ref = torch.autograd.grad(r_ref, (z, w_M, ex.w1, ex.w3, ex.w2), dr)
    assert max_abs_rel(r, r_ref) < 1e-6
    for a, b in zip(grads, grads_ref):
        assert max_abs_rel(a, b) < 2 ** -7


def test_own_experts_plus_replicas_gradcheck_float64():
    """GateUpGLU and GroupedDown over row groups of the own experts followed by replicas (balanced dispatch): the
    gradients of the own weights and of the replicas, each apart, against float64 finite differences."""
    from megatron_k3.ops.grouped_gemm import GroupedDown
    g = torch.Generator().manual_seed(5)
    E, S, L, I = 2, 2, 3, 4
    offs = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # an empty own group; rows after the last are ignored

    def t(*shape):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * 0.5).requires_grad_()
    x, w1, w3, r1, r3, w2, r2 = t(6, L), t(E, I, L), t(E, I, L), t(S, I, L), t(S, I, L), t(E, L, I), t(S, L, I)

    def f(x, w1, w3, r1, r3, w2, r2):
        h = GateUpGLU.apply(x, w1, w3, offs, "situ", 4.0, 25.0, r1, r3)
        return GroupedDown.apply(h, w2, r2, offs)
    assert torch.autograd.gradcheck(f, (x, w1, w3, r1, r3, w2, r2))
