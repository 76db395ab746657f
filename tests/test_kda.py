"""KDA ops: chunk_kda (torch path) and recurrent_kda against flash-linear-attention's naive recurrence."""

import functools
import importlib.util
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import load_file, max_abs_rel

from megatron_k3.ops import kda as kda_ops
from megatron_k3.ops.kda import chunk_kda, recurrent_kda, seq_idx_from_cu_seqlens
from megatron_k3.ops.short_conv import causal_conv1d, causal_conv1d_reference

# fp32 results against a reference: the chunked form sums up to chunk_size products in a different order than
# the recurrence, so both carry ~1e-7 relative rounding; 1e-5 leaves margin (measured as max|a-b| / max|b|).
RTOL = 1e-5


def _load_fla_naive():
    # load fla/ops/kda/naive.py by path: importing the fla package pulls in Triton and takes seconds
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("flash-linear-attention is not installed")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    return load_file(path, "_fla_kda_naive")


@functools.lru_cache(maxsize=None)
def fla_naive():
    return _load_fla_naive()


def make_inputs(B, T, H, K, V, HV=None, seed=0, gate="sigmoid", init=True, N=None):
    """q, k l2-normalised; g <= 0 per the chosen gate; beta in (0, 1). float64 leaves, shared by all runs."""
    HV = HV or H
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, HV, V)
    if gate == "sigmoid":  # K3's bounded gate: g in (-5, 0)
        g = -5.0 * torch.sigmoid(randn(B, T, HV, K))
    elif gate == "logsigmoid":  # Kimi-Linear-like, unbounded below but mostly mild
        g = F.logsigmoid(randn(B, T, HV, K) + 2.0)
    elif gate == "strong":  # every step close to the lower bound -5
        g = -5.0 * torch.sigmoid(8.0 + randn(B, T, HV, K))
    elif gate == "mixed":  # per channel anywhere in (-5, 0): strong and weak decays side by side
        g = -5.0 * torch.sigmoid(4.0 * randn(B, T, HV, K))
    elif gate == "kimi_strong":  # Kimi Linear's unbounded -e^A softplus(z), e^A up to 16: steps down to ~-100
        a = 1.0 + 15.0 * torch.rand(1, 1, HV, 1, generator=gen, dtype=torch.float64)
        g = -a * F.softplus(2.0 * randn(B, T, HV, K) + 1.0)
    else:
        raise AssertionError(gate)
    beta = torch.sigmoid(randn(B, T, HV))
    h0 = randn(N or B, HV, K, V) if init else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)


def run(fn, inputs, dtype, seed=1, **kwargs):
    """Forward + backward of (o, final_state) with fixed random cotangents; returns outputs and input grads."""
    leaves = {name: (x.detach().to(dtype).requires_grad_() if x is not None else None) for name, x in inputs.items()}
    o, s = fn(**leaves, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    ds = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.dtype)
    ((o * do).sum() + (s * ds).sum()).backward()
    grads = {f"d{name}": x.grad for name, x in leaves.items() if x is not None}
    return {"o": o.detach(), "final_state": s.detach(), **grads}


def assert_close(ours, ref, rtol=RTOL, label=""):
    assert ours.keys() == ref.keys()
    for name in ref:
        assert torch.isfinite(ours[name]).all(), f"{label} {name} is not finite"
        err = max_abs_rel(ours[name], ref[name])
        assert err < rtol, f"{label} {name}: relative error {err:.2e} >= {rtol:.0e}"


def naive_reference(inputs, dtype=torch.float32):
    naive = fla_naive().naive_recurrent_kda
    return run(lambda **kw: naive(**kw), inputs, dtype)


# ----------------------------------------------------------------------------------------------------------------
# chunk_kda against fla's naive recurrence


@functools.lru_cache(maxsize=None)
def _case(T, init):
    inputs = make_inputs(B=2, T=T, H=2, K=16, V=16, seed=T, init=init)
    return inputs, naive_reference(inputs)


@pytest.mark.parametrize("init", [False, True], ids=["zero_state", "init_state"])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("T", [1, 63, 64, 65])
def test_chunk_matches_naive_recurrent(T, chunk_size, init):
    inputs, ref = _case(T, init)
    ours = run(chunk_kda, inputs, torch.float32, chunk_size=chunk_size, backend="torch")
    assert_close(ours, ref, label=f"T={T} C={chunk_size}")


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_long_sequence(chunk_size):
    inputs, ref = _case(1000, True)
    ours = run(chunk_kda, inputs, torch.float32, chunk_size=chunk_size, backend="torch")
    assert_close(ours, ref, label=f"T=1000 C={chunk_size}")


@pytest.mark.parametrize("chunk_size", [1, 7, 20, 24])
def test_chunk_sizes_that_are_not_powers_of_two(chunk_size):
    # odd factors make the intra-chunk scores use pairwise diagonal blocks (e.g. 24 = 3 * 2^3)
    inputs = make_inputs(B=1, T=50, H=2, K=16, V=8, seed=3, gate="logsigmoid")
    ours = run(chunk_kda, inputs, torch.float32, chunk_size=chunk_size, backend="torch")
    assert_close(ours, naive_reference(inputs), label=f"C={chunk_size}")


def test_chunk_gva_matches_naive():
    inputs = make_inputs(B=1, T=70, H=2, K=16, V=8, HV=4, seed=5)
    ours = run(chunk_kda, inputs, torch.float32, chunk_size=32, backend="torch")
    assert_close(ours, naive_reference(inputs), label="HV=2H")


def test_auto_backend_on_cpu_is_the_torch_path():
    inputs = make_inputs(B=1, T=40, H=1, K=8, V=8, seed=6)
    args = {name: x.float() for name, x in inputs.items()}
    o_auto, _ = chunk_kda(**args, chunk_size=16)
    o_torch, _ = chunk_kda(**args, chunk_size=16, backend="torch")
    torch.testing.assert_close(o_auto, o_torch, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------------
# gates at K3's lower bound (-5 per step): a 64-token chunk reaches G = -320, where exp(-G) overflows fp32


@pytest.mark.parametrize("gate", ["strong", "mixed"])
def test_chunk_strong_gates_are_finite_and_exact(gate):
    inputs = make_inputs(B=1, T=150, H=2, K=16, V=16, seed=7, gate=gate)
    chunk_G = inputs["g"][:, :64].sum(1)
    assert chunk_G.min() < -88, "the test must reach a chunk decay whose reciprocal overflows fp32"
    ref = run(recurrent_kda, inputs, torch.float64)  # float64 reference
    ours = run(chunk_kda, inputs, torch.float32, chunk_size=64, backend="torch")
    assert_close(ours, ref, label=f"gate={gate}")


# ----------------------------------------------------------------------------------------------------------------
# packed documents


DOC_LENGTHS = [1, 17, 64, 100, 3]


def _per_document_reference(inputs, cu, fn, dtype, **kwargs):
    """Runs each document on its own (own initial state) and combines results and grads in the packed layout."""
    leaves = {name: (x.detach().to(dtype).requires_grad_() if x is not None else None) for name, x in inputs.items()}
    outs, finals = [], []
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        doc = {name: leaves[name][:, a:b] for name in ("q", "k", "v", "g", "beta")}
        h0 = leaves["initial_state"][n : n + 1] if leaves["initial_state"] is not None else None
        o, s = fn(**doc, initial_state=h0, output_final_state=True, **kwargs)
        outs.append(o)
        finals.append(s)
    o, s = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    ds = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.dtype)
    ((o * do).sum() + (s * ds).sum()).backward()
    grads = {f"d{name}": x.grad for name, x in leaves.items() if x is not None}
    return {"o": o.detach(), "final_state": s.detach(), **grads}


@pytest.mark.parametrize("init", [False, True], ids=["zero_state", "init_state"])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_cu_seqlens_matches_separate_documents(chunk_size, init):
    cu = [0]
    for n in DOC_LENGTHS:
        cu.append(cu[-1] + n)
    inputs = make_inputs(B=1, T=cu[-1], H=2, K=16, V=16, seed=11, init=init, N=len(DOC_LENGTHS))
    naive = fla_naive().naive_recurrent_kda
    ref = _per_document_reference(inputs, cu, naive, torch.float32)
    cu_t = torch.tensor(cu, dtype=torch.long)
    ours = run(chunk_kda, inputs, torch.float32, chunk_size=chunk_size, cu_seqlens=cu_t, backend="torch")
    assert_close(ours, ref, label=f"cu_seqlens C={chunk_size}")
    rec = run(recurrent_kda, inputs, torch.float32, cu_seqlens=cu_t)
    assert_close(rec, ref, label="recurrent cu_seqlens")


def test_cu_seqlens_with_an_empty_document_keeps_its_state():
    cu = [0, 5, 5, 30]
    inputs = make_inputs(B=1, T=30, H=1, K=8, V=8, seed=12, N=3)
    args = {name: x.float() for name, x in inputs.items()}
    _, s = chunk_kda(**args, output_final_state=True, chunk_size=16, cu_seqlens=torch.tensor(cu))
    torch.testing.assert_close(s[1], args["initial_state"][1], rtol=0, atol=0)
    ref = _per_document_reference(inputs, [0, 5, 30], recurrent_kda, torch.float64)
    assert max_abs_rel(s[[0, 2]], ref["final_state"]) < RTOL


# ----------------------------------------------------------------------------------------------------------------
# packed documents as seq_idx [B, T] (static shapes): fixed chunks with document masks


SEQ_T = 150  # not a multiple of 16 or 64: the last chunk is padded


def _random_row(seed, T=SEQ_T, cuts=8):
    """Document lengths of a row cut at random places (length-1 documents and chunk-boundary starts included)."""
    gen = torch.Generator().manual_seed(seed)
    starts = set(torch.randint(1, T, (cuts,), generator=gen).tolist()) | {64, 65, 66, 96}
    bounds = [0] + sorted(starts) + [T]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


# per layout two rows of different documents, T = SEQ_T each
SEQ_LAYOUTS = {
    # starts at 16, 32 (C=16) and at 64, 128 (C=16 and 64); documents of length 1; 48 and 68 span chunks
    "boundaries": [[1, 15, 16, 1, 1, 48, 68], [64, 1, 63, 22]],
    # a document over every chunk of the row, and a row that is one document
    "long": [[3, 140, 7], [SEQ_T]],
    "random": [_random_row(1), _random_row(2)],
}


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())


def _seq_idx(layout):
    """[B, T] document index per token; the second row's indices are spread out (any non-decreasing ints do)."""
    rows = [seq_idx_from_cu_seqlens(_cu(lengths), SEQ_T)[0] for lengths in layout]
    return torch.stack([rows[0]] + [3 * r + 7 for r in rows[1:]])


def run_o(fn, inputs, dtype, seed=1):
    """Forward + backward of the output only (seq_idx takes no states) with a fixed random cotangent."""
    leaves = {n: inputs[n].detach().to(dtype).requires_grad_() for n in ("q", "k", "v", "g", "beta")}
    o = fn(**leaves)
    gen = torch.Generator().manual_seed(seed)
    (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum().backward()
    return {"o": o.detach(), **{f"d{n}": x.grad for n, x in leaves.items()}}


def _per_row_and_document(layout, fn):
    """fn on every document of every row on its own (zero initial state), outputs put back in the packed layout."""
    def packed(**x):
        rows = []
        for b, lengths in enumerate(layout):
            cu = _cu(lengths).tolist()
            rows.append(torch.cat([fn(**{n: t[b:b + 1, s:e] for n, t in x.items()})[0]
                                   for s, e in zip(cu[:-1], cu[1:])], dim=1))
        return torch.cat(rows, dim=0)
    return packed


def _per_row_cu_seqlens(layout, **kw):
    """chunk_kda's cu_seqlens path row by row (it takes B = 1)."""
    def packed(**x):
        return torch.cat([chunk_kda(**{n: t[b:b + 1] for n, t in x.items()}, cu_seqlens=_cu(lengths), **kw)[0]
                          for b, lengths in enumerate(layout)], dim=0)
    return packed


@functools.lru_cache(maxsize=None)
def _seq_case(layout_name, gate):
    """Inputs and the per-document references: the repo's recurrence in fp64, fla's naive recurrence in fp32."""
    layout = SEQ_LAYOUTS[layout_name]
    inputs = make_inputs(B=2, T=SEQ_T, H=2, K=8, V=8, seed=21, gate=gate, init=False)
    ref64 = run_o(_per_row_and_document(layout, recurrent_kda), inputs, torch.float64)
    ref32 = run_o(_per_row_and_document(layout, fla_naive().naive_recurrent_kda), inputs, torch.float32)
    return inputs, ref64, ref32


@pytest.mark.parametrize("gate", ["sigmoid", "strong", "kimi_strong"])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("layout_name", list(SEQ_LAYOUTS))
def test_seq_idx_matches_cu_seqlens_and_separate_documents(layout_name, chunk_size, gate):
    """chunk_kda(seq_idx) = chunk_kda(cu_seqlens) = every document on its own: outputs and the gradients of q, k,
    v, g, beta, in fp64 (1e-10; measured <= 8e-16) and fp32 (1e-5; measured <= 3e-7)."""
    layout = SEQ_LAYOUTS[layout_name]
    inputs, ref64, ref32 = _seq_case(layout_name, gate)
    seq_idx = _seq_idx(layout)
    label = f"{layout_name} C={chunk_size} gate={gate}"

    def ours(**x):
        return chunk_kda(**x, chunk_size=chunk_size, seq_idx=seq_idx, backend="torch")[0]

    cu_fn = _per_row_cu_seqlens(layout, chunk_size=chunk_size, backend="torch")
    ours64 = run_o(ours, inputs, torch.float64)
    assert_close(ours64, ref64, rtol=1e-10, label=f"fp64 vs per-document recurrence {label}")
    assert_close(ours64, run_o(cu_fn, inputs, torch.float64), rtol=1e-10, label=f"fp64 vs cu_seqlens {label}")
    ours32 = run_o(ours, inputs, torch.float32)
    assert_close(ours32, ref32, label=f"fp32 vs fla naive per document {label}")
    assert_close(ours32, run_o(cu_fn, inputs, torch.float32), label=f"fp32 vs cu_seqlens {label}")
    assert_close(ours32, ref64, label=f"fp32 vs fp64 reference {label}")


@pytest.mark.parametrize("cut", [16, 64, 96])
@pytest.mark.parametrize("layout_name", list(SEQ_LAYOUTS))
def test_seq_idx_range_continues_the_state_of_the_range_before(layout_name, cut):
    """A row cut at a chunk boundary into two ranges: the first's final state with the document of its last token
    (`state_doc`) continues the second, and the two outputs are the whole row's; the final state is the
    recurrence's state of the row's last document (fp64 against the per-document recurrence, 1e-10)."""
    layout = SEQ_LAYOUTS[layout_name]
    x = {n: t for n, t in make_inputs(B=2, T=SEQ_T, H=2, K=8, V=8, seed=25, init=False).items()
         if n != "initial_state"}
    seq_idx = _seq_idx(layout)
    kw = dict(chunk_size=16, backend="torch", output_final_state=True)
    o1, S1 = chunk_kda(**{n: t[:, :cut] for n, t in x.items()}, seq_idx=seq_idx[:, :cut], **kw)
    o2, S2 = chunk_kda(**{n: t[:, cut:] for n, t in x.items()}, seq_idx=seq_idx[:, cut:], initial_state=S1,
                       state_doc=seq_idx[:, cut - 1], **kw)
    ref = _per_row_and_document(layout, recurrent_kda)(**x)
    assert max_abs_rel(torch.cat([o1, o2], dim=1), ref) < 1e-10
    for b, lengths in enumerate(layout):  # the state after each row's last token, in its document
        last = {n: t[b:b + 1, SEQ_T - lengths[-1]:] for n, t in x.items()}
        assert max_abs_rel(S2[b], recurrent_kda(**last, output_final_state=True)[1][0]) < 1e-10


def test_seq_idx_strong_gates_reach_the_fp32_overflow_range():
    # the cases above must include chunks whose total decay exp(-G) would overflow fp32 (G < -88)
    for gate in ("strong", "kimi_strong"):
        g = make_inputs(B=2, T=SEQ_T, H=2, K=8, V=8, seed=21, gate=gate, init=False)["g"]
        assert g[:, :64].sum(1).min() < -88, gate


def test_seq_idx_single_document_is_the_plain_path():
    inputs = make_inputs(B=2, T=70, H=2, K=8, V=8, seed=22, init=False)
    x = {n: inputs[n].float() for n in ("q", "k", "v", "g", "beta")}
    o_plain, _ = chunk_kda(**x, chunk_size=16, backend="torch")
    o_seq, _ = chunk_kda(**x, chunk_size=16, seq_idx=torch.zeros(2, 70, dtype=torch.long), backend="torch")
    assert max_abs_rel(o_seq, o_plain) < 1e-6


def test_seq_idx_on_the_fla_path_packs_the_rows():
    """On CUDA, fla's kernel gets the B rows as one packed row with the equivalent cu_seqlens; checked here with
    the torch kernel standing in for fla's."""
    layout = SEQ_LAYOUTS["boundaries"]
    inputs = make_inputs(B=2, T=SEQ_T, H=2, K=8, V=8, seed=23, init=False)
    x = {n: inputs[n] for n in ("q", "k", "v", "g", "beta")}
    seq_idx = _seq_idx(layout)
    stand_in = functools.partial(chunk_kda, chunk_size=64, backend="torch")
    o, final = kda_ops._fla_seq_idx(stand_in, *x.values(), None, seq_idx, {})
    assert final is None
    assert kda_ops._seq_idx_to_cu_seqlens(seq_idx).tolist() == (
        _cu(layout[0]).tolist() + (SEQ_T + _cu(layout[1])[1:]).tolist())
    ref = _per_row_and_document(layout, recurrent_kda)(**x)
    assert max_abs_rel(o, ref) < 1e-12


@pytest.mark.parametrize("chunk_size,lower_bound", [(32, -5.0), (64, None)])
def test_the_fla_path_passes_the_chunk_length_and_the_gate_bound(monkeypatch, chunk_size, lower_bound):
    """fla's chunk_kda takes chunk_size as a keyword (64 when not given): chunk_kda's (model.kda_chunk_size) reaches
    it, and K3's gate bound turns on its bounded-gate path. No CUDA here: chunk_kda is told fla's kernel runs
    (runs_fused) and the torch kernel stands in for it."""
    inputs = make_inputs(B=1, T=96, H=2, K=8, V=8, seed=5, init=False)
    x = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    seen = []

    def stand_in(*a, chunk_size=64, safe_gate=False, lower_bound=None, **kw):
        seen.append((chunk_size, safe_gate, lower_bound))
        return chunk_kda(*a, chunk_size=chunk_size, backend="torch", **kw)

    want = chunk_kda(*x, chunk_size=chunk_size, backend="torch")[0]
    monkeypatch.setattr(kda_ops, "runs_fused", lambda q, c, b="auto": True)
    monkeypatch.setattr(kda_ops, "_fla_chunk_kda", lambda: stand_in)
    o, _ = chunk_kda(*x, chunk_size=chunk_size, lower_bound=lower_bound)
    assert seen == [(chunk_size, lower_bound is not None, lower_bound)]
    assert torch.equal(o, want)


def test_seq_idx_from_cu_seqlens_skips_empty_documents():
    assert seq_idx_from_cu_seqlens(torch.tensor([0, 2, 2, 5, 6]), 6).tolist() == [[0, 0, 2, 2, 2, 3]]


def _seq_idx_bad_cases():
    B, T, H, K = 2, 10, 2, 4
    ok = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, K),
              g=-torch.rand(B, T, H, K), beta=torch.rand(B, T, H), seq_idx=torch.zeros(B, T, dtype=torch.long))
    one = {n: x[:1] for n, x in ok.items()}
    return [
        ("seq_idx", dict(ok, seq_idx=torch.zeros(1, T, dtype=torch.long))),  # wrong B
        ("seq_idx", dict(ok, seq_idx=torch.zeros(B * T, dtype=torch.long))),  # not [B, T]
        ("seq_idx", dict(ok, seq_idx=torch.zeros(B, T))),  # float
        ("cu_seqlens", dict(one, cu_seqlens=torch.tensor([0, 4, 10]))),
        ("state_doc", dict(ok, initial_state=torch.zeros(B, H, K, K))),  # a state without its document
        ("state_doc", dict(ok, state_doc=torch.zeros(B, dtype=torch.long))),  # a document without its state
        ("state_doc", dict(ok, initial_state=torch.zeros(B, H, K, K), state_doc=torch.zeros(B))),  # float
        ("state_doc", dict(ok, initial_state=torch.zeros(B, H, K, K), state_doc=torch.zeros(1, dtype=torch.long))),
        ("state_doc", dict({n: x for n, x in ok.items() if n != "seq_idx"},
                           state_doc=torch.zeros(B, dtype=torch.long))),
    ]


@pytest.mark.parametrize("arg,kwargs", _seq_idx_bad_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_seq_idx_bad_inputs_raise_value_error_naming_the_argument(arg, kwargs):
    with pytest.raises(ValueError, match=arg):
        chunk_kda(**kwargs, backend="torch")


def _small_packed_inputs(T=40, seed=24):
    inputs = make_inputs(B=1, T=T, H=2, K=8, V=8, seed=seed, init=False)
    return [inputs[n].float() for n in ("q", "k", "v", "g", "beta")]


def test_seq_idx_chunk_kda_traces_without_graph_breaks():
    q, k, v, g, beta = _small_packed_inputs()
    seq_idx = seq_idx_from_cu_seqlens(torch.tensor([0, 3, 16, 17, 40]), 40)

    def fn(q, k, v, g, beta, seq_idx):
        return chunk_kda(q, k, v, g, beta, chunk_size=16, seq_idx=seq_idx, backend="torch")[0]

    explained = torch._dynamo.explain(fn)(q, k, v, g, beta, seq_idx)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_seq_idx_chunk_kda_does_not_recompile_for_a_new_document_layout():
    q, k, v, g, beta = _small_packed_inputs()
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda *a: chunk_kda(*a[:5], chunk_size=16, seq_idx=a[5], backend="torch")[0],
                       backend=count, fullgraph=True)
    for cu in ([0, 3, 16, 17, 40], [0, 40], [0, 1, 2, 3, 4, 5, 20, 21, 39, 40]):  # 4, 1 and 9 documents
        seq_idx = seq_idx_from_cu_seqlens(torch.tensor(cu), 40)
        o = fn(q, k, v, g, beta, seq_idx)
        ref, _ = chunk_kda(q, k, v, g, beta, chunk_size=16, cu_seqlens=torch.tensor(cu), backend="torch")
        assert max_abs_rel(o, ref) < RTOL
    assert len(graphs) == 1
    torch._dynamo.reset()


def test_short_conv_seq_idx_equals_cu_seqlens():
    """causal_conv1d(seq_idx) over two rows of different documents = causal_conv1d(cu_seqlens) row by row = each
    document on its own; outputs and gradients in fp64."""
    gen = torch.Generator().manual_seed(25)
    layout = SEQ_LAYOUTS["boundaries"]
    x = torch.randn(2, SEQ_T, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, SEQ_T, 6, generator=gen, dtype=torch.float64)
    results = []
    for how in ("seq_idx", "cu_seqlens", "separate"):
        if how == "seq_idx":
            y, cache = causal_conv1d(x, w, seq_idx=_seq_idx(layout))
            assert cache is None
        elif how == "cu_seqlens":
            y = torch.cat([causal_conv1d(x[b:b + 1], w, cu_seqlens=_cu(layout[b]))[0] for b in range(2)])
        else:
            y = torch.cat([torch.cat([causal_conv1d_reference(x[b:b + 1, s:e], w)
                                      for s, e in zip(_cu(layout[b])[:-1], _cu(layout[b])[1:])], dim=1)
                           for b in range(2)])
        dx, dw = torch.autograd.grad((y * dy).sum(), (x, w))
        results.append((y, dx, dw))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert max_abs_rel(a, b) < 1e-12
    with pytest.raises(ValueError, match="seq_idx"):
        causal_conv1d(x, w, seq_idx=torch.zeros(1, SEQ_T, dtype=torch.long))


# ----------------------------------------------------------------------------------------------------------------
# the recurrent reference itself


@pytest.mark.parametrize("HV", [2, 4], ids=["HV=H", "HV=2H"])
def test_recurrent_matches_naive_recurrent(HV):
    inputs = make_inputs(B=2, T=37, H=2, K=16, V=8, HV=HV, seed=13)
    ours = run(recurrent_kda, inputs, torch.float32)
    assert_close(ours, naive_reference(inputs), label=f"recurrent HV={HV}")


def test_decode_steps_continue_the_prefill():
    inputs = make_inputs(B=2, T=70, H=2, K=16, V=16, seed=14)
    args = {name: x.float() for name, x in inputs.items()}
    o_full, s_full = chunk_kda(**args, output_final_state=True, backend="torch")
    head = {name: args[name][:, :67] for name in ("q", "k", "v", "g", "beta")}
    _, s = chunk_kda(**head, initial_state=args["initial_state"], output_final_state=True, backend="torch")
    for t in range(67, 70):
        step = {name: args[name][:, t : t + 1] for name in ("q", "k", "v", "g", "beta")}
        o_t, s = recurrent_kda(**step, initial_state=s, output_final_state=True)
        assert max_abs_rel(o_t[:, 0], o_full[:, t]) < RTOL
    assert max_abs_rel(s, s_full) < RTOL


def test_dtypes_and_optional_state():
    inputs = make_inputs(B=1, T=20, H=1, K=8, V=8, seed=15, init=False)
    args = {name: (x.bfloat16() if x is not None else None) for name, x in inputs.items()}
    for fn in (chunk_kda, recurrent_kda):
        o, s = fn(**args)
        assert o.dtype == torch.bfloat16 and s is None
        o, s = fn(**args, output_final_state=True)
        assert s.dtype == torch.float32 and s.shape == (1, 1, 8, 8)


# ----------------------------------------------------------------------------------------------------------------
# input validation and imports


def _bad_cases():
    B, T, H, K, V = 2, 10, 2, 4, 4
    ok = dict(
        q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, V),
        g=-torch.rand(B, T, H, K), beta=torch.rand(B, T, H),
    )
    one = {name: x[:1] for name, x in ok.items()}
    return [
        ("q", dict(ok, q=torch.randn(B, T, H * K))),
        ("k", dict(ok, k=torch.randn(B, T, H, K + 1))),
        ("v", dict(ok, v=torch.randn(B, T + 1, H, V))),
        ("v", dict(ok, v=torch.randn(B, T, 3, V))),  # HV not a multiple of H
        ("g", dict(ok, g=-torch.rand(B, T, H, K + 1))),
        ("beta", dict(ok, beta=torch.rand(B, T, H, 1))),
        ("initial_state", dict(ok, initial_state=torch.zeros(B, H, K, V + 1))),
        ("cu_seqlens", dict(ok, cu_seqlens=torch.tensor([0, 4, 10]))),  # B != 1
        ("cu_seqlens", dict(one, cu_seqlens=torch.tensor([0, 6, 4, 10]))),  # not monotonic
        ("cu_seqlens", dict(one, cu_seqlens=torch.tensor([0, 4, 9]))),  # does not end at T
        ("cu_seqlens", dict(one, cu_seqlens=torch.tensor([[0, 10]]))),  # not 1-D
        ("initial_state", dict(one, cu_seqlens=torch.tensor([0, 4, 10]), initial_state=torch.zeros(1, H, K, V))),
        ("chunk_size", dict(ok, chunk_size=0)),
        ("chunk_size", dict(ok, chunk_size=16.0)),
    ]


@pytest.mark.parametrize("arg,kwargs", _bad_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_inputs_raise_value_error_naming_the_argument(arg, kwargs):
    with pytest.raises(ValueError, match=arg):
        chunk_kda(**kwargs)
    if arg != "chunk_size":
        with pytest.raises(ValueError, match=arg):
            recurrent_kda(**kwargs)


def test_backend_choice():
    args = dict(q=torch.randn(1, 4, 1, 4), k=torch.randn(1, 4, 1, 4), v=torch.randn(1, 4, 1, 4),
                g=-torch.rand(1, 4, 1, 4), beta=torch.rand(1, 4, 1))
    with pytest.raises(ValueError, match="backend"):
        chunk_kda(**args, backend="triton")
    with pytest.raises(RuntimeError, match="fla"):
        chunk_kda(**args, backend="fla")  # CPU tensors


def test_import_does_not_touch_fla_or_triton():
    code = "import sys, megatron_k3.ops.kda; bad = [m for m in ('fla', 'triton') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
