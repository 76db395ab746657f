"""Short convolution, AttnRes, SiTU and attention with a narrower value head against plain references (including
gradients)."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import load_file, max_abs_rel

from megatron_k3.ops.attention import attention
from megatron_k3.ops.attn_res import attn_res, attn_res_block_stats, attn_res_merge
from megatron_k3.ops.glu import glu_act, situ
from megatron_k3.ops.short_conv import causal_conv1d, causal_conv1d_reference


def _load_fla_naive_attnres():
    spec = importlib.util.find_spec("fla")
    if spec is None:
        pytest.skip("flash-linear-attention is not installed")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "attnres" / "naive.py"
    return load_file(path, "_fla_attnres_naive").naive_attnres


@pytest.mark.parametrize("T", [1, 3, 17])
def test_short_conv_matches_conv1d(T):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(2, T, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    y, _ = causal_conv1d(x, w)
    ref = causal_conv1d_reference(x, w)
    assert max_abs_rel(y, ref) < 1e-12
    gy = torch.randn_like(y)
    ga = torch.autograd.grad(y, (x, w), gy)
    gb = torch.autograd.grad(ref, (x, w), gy)
    for a, b in zip(ga, gb):
        assert max_abs_rel(a, b) < 1e-12


def test_short_conv_cache_continues_sequence():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 23, 5, generator=g, dtype=torch.float64)
    w = torch.randn(5, 4, generator=g, dtype=torch.float64)
    full, _ = causal_conv1d(x, w)
    outs, cache = [], None
    for a, b in [(0, 10), (10, 11), (11, 12), (12, 23)]:  # a prefill, two single steps, a chunk
        y, cache = causal_conv1d(x[:, a:b], w, cache, output_cache=True)
        outs.append(y)
    assert max_abs_rel(torch.cat(outs, 1), full) < 1e-12


def test_short_conv_respects_document_boundaries():
    g = torch.Generator().manual_seed(2)
    lengths = [1, 5, 2, 9]
    x = torch.randn(1, sum(lengths), 4, generator=g, dtype=torch.float64)
    w = torch.randn(4, 4, generator=g, dtype=torch.float64)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    y, _ = causal_conv1d(x, w, cu_seqlens=cu)
    ref = torch.cat([causal_conv1d_reference(x[:, a:b], w) for a, b in zip(cu[:-1], cu[1:])], dim=1)
    assert max_abs_rel(y, ref) < 1e-12


def test_attn_res_matches_fla_naive():
    naive = _load_fla_naive_attnres()
    g = torch.Generator().manual_seed(3)
    D = 16
    srcs = [torch.randn(2, 7, D, generator=g, dtype=torch.float64) * (i + 1) for i in range(4)]
    q = torch.randn(D, generator=g, dtype=torch.float64)
    w = 1 + 0.1 * torch.randn(D, generator=g, dtype=torch.float64)
    ours = attn_res([s.float() for s in srcs], q.float(), w.float(), eps=1e-6)
    ref = naive(q, srcs, w, rms_eps=1e-6)
    assert max_abs_rel(ours, ref) < 1e-5  # fp32 ours vs fp64 reference


def test_attn_res_zero_query_is_uniform_mean():
    srcs = [torch.randn(3, 8) for _ in range(5)]
    out = attn_res(srcs, torch.zeros(8), torch.ones(8))
    assert max_abs_rel(out, torch.stack(srcs).mean(0)) < 1e-6


def test_attn_res_two_phase_equals_one_shot():
    g = torch.Generator().manual_seed(4)
    D, Q = 12, 3
    blocks = [torch.randn(2, 5, D, generator=g) for _ in range(3)]
    partials = [torch.randn(2, 5, D, generator=g) for _ in range(Q)]
    qs, ws = torch.randn(Q, D, generator=g), 1 + 0.1 * torch.randn(Q, D, generator=g)
    stats = attn_res_block_stats(blocks, qs, ws)
    for i in range(Q):
        two = attn_res_merge(stats, i, partials[i], qs[i], ws[i])
        one = attn_res(blocks + [partials[i]], qs[i], ws[i])
        assert max_abs_rel(two, one) < 1e-5


def test_situ_glu_formula_and_gradient():
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(64, generator=g, dtype=torch.float64) * 6).requires_grad_()
    u = (torch.randn(64, generator=g, dtype=torch.float64) * 40).requires_grad_()
    h = glu_act(a, u, "situ", 4.0, 25.0)
    ref = 4.0 * torch.tanh(a / 4.0) * torch.sigmoid(a) * 25.0 * torch.tanh(u / 25.0)
    assert max_abs_rel(h, ref) < 1e-12
    assert h.abs().max() <= 100.0  # bounded by beta_gate * beta_up
    ga, gu = torch.autograd.grad(h.sum(), (a, u))
    sig = torch.sigmoid(a)
    d_situ = (1 - torch.tanh(a / 4) ** 2) * sig + 4 * torch.tanh(a / 4) * sig * (1 - sig)
    assert max_abs_rel(ga, d_situ * 25 * torch.tanh(u / 25)) < 1e-10
    assert max_abs_rel(gu, situ(a, 4.0) * (1 - torch.tanh(u / 25) ** 2)) < 1e-10
    # near zero SiTU-GLU is SwiGLU
    small = torch.linspace(-1e-3, 1e-3, 11, dtype=torch.float64)
    assert max_abs_rel(glu_act(small, small, "situ"), F.silu(small) * small) < 1e-5


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mask", ["causal", "document"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_with_narrower_values_runs_the_flash_kernel_and_matches_softmax(dtype, mask):
    """ops.attention with MLA's head dims (keys 48 = 32 + 16, values 32) against the plain softmax(q k^T) v in fp64:
    output and the gradients of q, k, v within 1e-5 (fp32) / 2e-2 (bf16, its 8-bit mantissa) of the largest
    element; torch's CPU flash kernel runs forward and backward (no [B, H, T, S] probabilities, no math fallback)."""
    g = torch.Generator().manual_seed(7)
    B, H, T, S, K, V = 2, 3, 40, 56, 48, 32  # queries at the end of the keys (a CP query block's shape)
    q, k, v = (torch.randn(B, H, n, d, generator=g) for n, d in ((T, K), (S, K), (S, V)))
    keep = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]
    if mask == "document":
        keep = keep & ((torch.arange(S)[None, :] >= 20) == (torch.arange(S - T, S)[:, None] >= 20))
    do = torch.randn(B, H, T, V, generator=g)
    results = []
    for fn, dt in ((None, torch.float64), (attention, dtype)):
        xs = [x.to(dt).requires_grad_() for x in (q, k, v)]
        ops = _Ops()
        with ops:
            if fn is None:
                s = (xs[0] @ xs[1].transpose(-1, -2)) * K**-0.5
                o = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1) @ xs[2]
            else:
                o = fn(*xs, attn_mask=keep)
            o.backward(do.to(dt))
        results.append([o.detach().double()] + [x.grad.double() for x in xs])
    assert any("flash_attention_for_cpu_backward" in n for n in ops.names), sorted(ops.names)
    assert not any("softmax" in n for n in ops.names), sorted(ops.names)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, got, ref in zip(("o", "dq", "dk", "dv"), results[1], results[0]):
        assert got.shape == ref.shape and max_abs_rel(got, ref) < tol, (name, max_abs_rel(got, ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sq_norm64_is_the_float64_sum_of_squares_chunk_by_chunk(dtype):
    """ops.numerics.sq_norm64 (every gradient norm: ZeRO's, ZeRO-0's, the routed experts'): over more than one chunk
    and a partial last one, the float64 sum of the exact squares, to float64 rounding (1e-15 relative)."""
    from megatron_k3.ops.numerics import SQ_NORM_CHUNK, sq_norm64

    t = torch.randn(3, 2 * SQ_NORM_CHUNK // 3 + 4115, generator=torch.Generator().manual_seed(3)).to(dtype)
    got, want = sq_norm64(t), t.double().pow(2).sum()
    assert got.dtype == torch.float64 and got.dim() == 0
    assert abs(got.item() - want.item()) <= 1e-15 * want.item()


def _autocast_bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_fp32_math_stays_fp32_under_a_bf16_autocast():
    """What runs in fp32 on purpose runs in fp32 under the bf16 autocast the Trainer puts around the forward (which
    would run its GEMMs, matmuls and einsums in bf16): the router's scores and combine weights, and KDA's torch path
    (chunked and step by step), bit for bit the same calls without autocast, gradients included."""
    from megatron_k3.model.router import TopKRouter
    from megatron_k3.ops.kda import chunk_kda, recurrent_kda

    g = torch.Generator().manual_seed(5)
    router = TopKRouter(32, 16, 4)
    router.weight.data.normal_(0, 0.2, generator=g)
    x = torch.randn(24, 32, generator=g)
    plain = router(x)
    with _autocast_bf16():
        cast = router(x)
    assert cast.scores_NE.dtype == cast.topk_weight_Nk.dtype == torch.float32
    assert torch.equal(cast.scores_NE, plain.scores_NE) and torch.equal(cast.topk_idx_Nk, plain.topk_idx_Nk)
    assert torch.equal(cast.topk_weight_Nk, plain.topk_weight_Nk)

    q, k = (F.normalize(torch.randn(1, 40, 2, 8, generator=g), dim=-1) for _ in range(2))
    ins = dict(q=q, k=k, v=torch.randn(1, 40, 2, 8, generator=g), g=-torch.rand(1, 40, 2, 8, generator=g),
               beta=torch.rand(1, 40, 2, generator=g))
    for fn, kw in ((chunk_kda, dict(chunk_size=16, backend="torch")), (recurrent_kda, {})):
        outs = []
        for autocast in (False, True):
            leaves = {n: t.clone().requires_grad_() for n, t in ins.items()}
            with _autocast_bf16() if autocast else torch.autocast("cpu", enabled=False):
                o, _ = fn(**leaves, **kw)
            o.square().sum().backward()
            outs.append([o] + [t.grad for t in leaves.values()])
        assert outs[1][0].dtype == torch.float32 and all(torch.equal(a, b) for a, b in zip(*outs)), fn.__name__


def test_routed_experts_take_the_autocast_dtype_of_an_fp32_input():
    """A model without the latent projection (Kimi Linear) hands its routed experts the fp32 residual stream; under a
    bf16 autocast their grouped GEMMs run in bf16, as its linears do (autocast does not list torch._grouped_mm, which
    would otherwise run them in fp32): the same output as the input cast to bf16 first."""
    from megatron_k3.model.experts import GroupedExperts

    g = torch.Generator().manual_seed(6)
    experts = GroupedExperts(4, 16, 32, "situ")
    for w in experts.parameters():
        w.data.normal_(0, 0.2, generator=g)
    x, offs = torch.randn(24, 16, generator=g), torch.tensor([5, 11, 11, 24])
    with _autocast_bf16():
        got = experts(x, offs)
        ref = experts(x.bfloat16(), offs)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)
