"""Each of our single-process autograd.Functions, compiled, gives eager's gradients: torch.compile with the aot_eager
backend (dynamo's graph and AOTAutograd's joint forward/backward run op by op, no code generation) against eager,
every input's gradient bit for bit.

Why: torch 2.11 (the lent GPU machine's) gave a Function output that is a no-op `.to` of a tensor made in the forward,
or an in-place op's result, no gradient under compile, silently (ops.numerics.in_dtype). SiTU's GLU, the experts'
DownCombine and MX QAT's fake-quantiser each did; the compiled model's gradients were zero or 4% off. Under torch 2.13
these pass with or without the workarounds; `make test-device-torch` runs them under 2.11, where they fail without
them. The Functions that need process groups (the TP/EP collectives, the balanced dispatch's row take, the
vocabulary-parallel loss) are covered by tests/test_compile.py's tp2, ep2 and balanced runs."""

from __future__ import annotations

import pytest
import torch

from megatron_k3.model.experts import GroupedExperts
from megatron_k3.ops import mx
from megatron_k3.ops.frozen_experts import ExpertAdapters, PackedExperts, frozen_experts_grouped
from megatron_k3.ops.glu import glu_act
from megatron_k3.ops.mx import fake_quant_mx
from megatron_k3.precision.qat import ExpertQAT

E, L, I = 4, 64, 32
COUNTS = torch.tensor([5, 0, 3, 8])  # expert-sorted rows per expert, one expert without any


def _inputs(*shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * 0.5).to(dtype) for s in shapes]


def _experts(qat=None, recompute_act=False):
    torch.manual_seed(1)
    ex = GroupedExperts(E, L, I, "situ")
    with torch.no_grad():
        for w in (ex.w1, ex.w3, ex.w2):
            w.normal_(0, 0.1)
    ex.qat, ex.recompute_act = qat, recompute_act
    return ex


def _rows(ex, z):
    return ex(z, COUNTS.cumsum(0))


_G = torch.Generator().manual_seed(2)
COMBINE = (torch.rand(int(COUNTS.sum()), generator=_G), torch.randint(0, 7, (int(COUNTS.sum()),), generator=_G), 7)


def _combined(ex, z):
    """The down projection fused with the combine: weighted rows summed into 7 token rows."""
    return ex(z, COUNTS.cumsum(0), combine=COMBINE)


def _replicas(ex, z):
    """Own experts' rows, then two replicas' (the balanced dispatch's forward_with): copies of experts 0 and 2."""
    reps = [w[[0, 2]] for w in (ex.w1, ex.w3, ex.w2)]
    offs = torch.cat([COUNTS, torch.tensor([2, 4])]).cumsum(0)
    return ex.forward_with(torch.cat([z, z[:6]]), offs, reps)


def _frozen():
    """LoRA's frozen experts: (forward over the rows and six adapter matrices, their values). They read the experts'
    row spans on the host, a graph break: their Function runs eagerly inside the compiled caller."""
    g = torch.Generator().manual_seed(3)
    packed = [PackedExperts.encode(torch.randn(E, *s, generator=g) * 0.1) for s in ((I, L), (I, L), (L, I))]
    ab = [torch.randn(E, *s, generator=g) * 0.1 for s in ((4, L), (I, 4), (4, L), (I, 4), (4, I), (L, 4))]

    def forward(z, *ab):
        return frozen_experts_grouped(z, COUNTS.cumsum(0), *packed, "situ", block=2, adapters=ExpertAdapters(*ab, 2.0))
    return forward, _inputs((int(COUNTS.sum()), L)) + ab


CASES = {
    "situ_glu": lambda: (lambda g, u: glu_act(g, u, "situ"), _inputs((6, 32), (6, 32))),
    "silu_glu": lambda: (lambda g, u: glu_act(g, u, "silu"), _inputs((6, 32), (6, 32))),
    "situ_glu_bf16": lambda: (lambda g, u: glu_act(g, u, "situ"), _inputs((6, 32), (6, 32), dtype=torch.bfloat16)),
    "fake_quant_e4m3": lambda: (lambda x: fake_quant_mx(x, "e4m3") * 1.5, _inputs((6, 64))),
    "fake_quant_e2m1_bf16": lambda: (lambda x: fake_quant_mx(x, "e2m1") * 1.5, _inputs((6, 64), dtype=torch.bfloat16)),
    "frozen_experts_lora": _frozen,
}
EXPERT_CASES = {  # (forward over (module, rows), module kwargs)
    "experts_grouped": (_rows, {}),
    "experts_down_combine": (_combined, {}),
    "experts_recompute_act": (_combined, {"recompute_act": True}),
    "experts_replicas": (_replicas, {}),
    "experts_mx_qat": (_rows, {"qat": ExpertQAT()}),
    "experts_mx_qat_combine": (_combined, {"qat": ExpertQAT()}),
}


def _grads(fn, leaves, compiled):
    """(output, gradients of every leaf) of fn under eager or aot_eager, for a fixed random output gradient."""
    torch._dynamo.reset()
    run = torch.compile(fn, backend="aot_eager") if compiled else fn
    xs = [x.detach().clone().requires_grad_(True) for x in leaves]
    out = run(*xs)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out.float() * dy).sum().backward()
    return out.detach(), [x.grad for x in xs]


def _assert_same(name, eager, compiled):
    (ye, ge), (yc, gc) = eager, compiled
    assert torch.equal(ye, yc), f"{name}: compiled output differs from eager"
    for i, (a, b) in enumerate(zip(ge, gc)):
        assert a is not None and a.abs().sum() > 0, f"{name}: eager gradient {i} is missing or zero"
        assert b is not None, f"{name}: compiled run made no gradient for input {i}"
        assert torch.equal(a, b), f"{name}: gradient {i} compiled differs from eager by {(a - b).abs().max():.3g}" \
                                  f" (largest {a.abs().max():.3g})"


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_function_gives_eager_gradients(name):
    fn, xs = CASES[name]()
    _assert_same(name, _grads(fn, xs, False), _grads(fn, xs, True))


@pytest.mark.parametrize("name", list(EXPERT_CASES))
def test_compiled_experts_give_eager_gradients(name):
    """GroupedExperts' Functions (GateUpGLU, GroupedDown, DownCombine, with MX QAT's fake-quantiser inside): the
    rows' gradient and every weight's, each run on fresh copies of the same values."""
    forward, kwargs = EXPERT_CASES[name]
    z = _inputs((int(COUNTS.sum()), L))[0]
    ex = _experts(**kwargs)
    weights = [ex.w1.detach(), ex.w3.detach(), ex.w2.detach()]
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        leaves = [t.clone().requires_grad_(True) for t in [z] + weights]
        ex.w1, ex.w3, ex.w2 = (torch.nn.Parameter(w) for w in leaves[1:])
        run = torch.compile(forward, backend="aot_eager") if compiled else forward
        out = run(ex, leaves[0])
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
        (out * dy).sum().backward()
        results.append((out.detach(), [leaves[0].grad, ex.w1.grad, ex.w3.grad, ex.w2.grad]))
    _assert_same(name, *results)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_fake_quant_in_chunks_gives_eager_gradients(monkeypatch, dtype):
    """The fake-quantiser over a tensor larger than ROUND_TRIP_CHUNK writes its output chunk by chunk into one buffer
    (K3's activations at 4096 tokens take this path): compiled, the same output and gradient as eager."""
    monkeypatch.setattr(mx, "ROUND_TRIP_CHUNK", 128)  # 6 rows of 64: three chunks of two rows
    xs = _inputs((6, 64), dtype=dtype)
    fn = lambda x: fake_quant_mx(x, "e4m3") * 1.5  # noqa: E731
    _assert_same("fake_quant_chunks", _grads(fn, xs, False), _grads(fn, xs, True))
