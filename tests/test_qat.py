"""precision=mx_qat (the routed experts' MX fake-quantisation), its K3 checkpoint export/import (bit-exact against
the QAT forward), the precision config, and the TransformerEngine precisions' failure on a CPU machine."""

import importlib.util
import sys

import pytest
import torch

from megatron_k3.config import ConfigError, PrecisionConfig, RunConfig, compose_run_config, load_model_config
from megatron_k3.interop.k3_experts import (
    dequantize_k3_weight,
    export_model_experts,
    import_model_experts,
    quantize_k3_weight,
)
from megatron_k3.model import K3ForCausalLM
from megatron_k3.model.experts import GroupedExperts
from megatron_k3.ops.glu import glu_act
from megatron_k3.ops.mx import fake_quant_mx
from megatron_k3.precision import (
    ExpertQAT,
    autocast_dtype,
    enable_expert_qat,
    forward_context,
    prepare_model_for_precision,
)

MX_QAT = PrecisionConfig(name="mx_qat", dtype="bf16")


@pytest.fixture(scope="module")
def tiny():
    return load_model_config("k3_tiny")


def _experts(seed=0, E=4, L=64, I=64):
    torch.manual_seed(seed)
    ex = GroupedExperts(E, L, I, "situ")
    for p in ex.parameters():
        p.data.normal_(0, 0.05)
    counts = torch.tensor([5, 0, 9, 6])
    z = torch.randn(int(counts.sum()), L)
    return ex, z, torch.cumsum(counts, 0)


def test_expert_forward_is_the_fake_quantised_computation():
    """QAT forward == the plain computation on fake-quantised weights (E2M1 along the reduction dim: L for
    w1/w3 [E, I, L], I for w2 [E, L, I]), input and SiTU output (E4M3); gradients reach the fp32 masters
    straight through."""
    ex, z, offs = _experts()
    ex.qat = ExpertQAT()
    zq = z.clone().requires_grad_()
    y = ex(zq, offs)
    g = torch.randn_like(y)
    y.backward(g)
    starts = [0] + offs[:-1].tolist()
    ref_w = {n: fake_quant_mx(getattr(ex, n).detach(), "e2m1").requires_grad_() for n in ("w1", "w2", "w3")}
    zr = z.clone().requires_grad_()
    zf = fake_quant_mx(zr, "e4m3")
    outs = []
    for e, (s, t) in enumerate(zip(starts, offs.tolist())):
        h = glu_act(zf[s:t] @ ref_w["w1"][e].T, zf[s:t] @ ref_w["w3"][e].T, "situ")
        outs.append(fake_quant_mx(h, "e4m3") @ ref_w["w2"][e].T)
    ref = torch.cat(outs)
    ref.backward(g)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-6)  # fp32; grouped_mm vs per-expert matmul summation order
    for n in ("w1", "w2", "w3"):
        assert torch.allclose(getattr(ex, n).grad, ref_w[n].grad, rtol=1e-4, atol=1e-6)
    assert torch.allclose(zq.grad, zr.grad, rtol=1e-4, atol=1e-6)
    ex.qat = None
    assert not torch.allclose(ex(z, offs), ref, rtol=1e-3, atol=1e-4)  # the hook is what changed the result


def _up_front(ex, z, offs, combine, replicas):
    """The QAT computation as autograd records it with each weight fake-quantised up front (fake_quant_mx's
    straight-through Function on w1, w3, w2 and the replicas; the way the experts ran it before their Functions took
    the quantiser): its graph keeps the quantised copies."""
    from megatron_k3.ops.grouped_gemm import DownCombine, GateUpGLU, GroupedDown, grouped_mm

    def q(w):
        return fake_quant_mx(w, "e2m1")
    x = fake_quant_mx(z, "e4m3")
    w1, w3, w2 = q(ex.w1), q(ex.w3), q(ex.w2)
    r1, r3, r2 = (None, None, None) if replicas is None else (q(r) for r in replicas)
    h = fake_quant_mx(GateUpGLU.apply(x, w1, w3, offs, "situ", 4.0, 25.0, r1, r3), "e4m3")
    if replicas is not None:
        return GroupedDown.apply(h, w2, r2, offs)
    if combine is not None:
        return DownCombine.apply(h, w2, offs, *combine)
    return torch.bmm(h, w2.transpose(1, 2)) if offs is None else grouped_mm(h, w2.transpose(1, 2), offs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["grouped", "batched", "combine", "replicas"])
def test_qat_inside_the_gemms_is_bit_identical_and_keeps_no_weight_copy(path, dtype):
    """The experts fake-quantise their weights inside the GEMMs' Functions (forward, and again in the backward):
    outputs and every gradient (input, w1, w3, w2, the routing weights, the replicas') bit for bit those of the
    weights quantised up front, for grouped rows, the static [E, C, L] buffers, the fused combine and the balanced
    dispatch's replicas; and what the forward leaves live for the backward is no more than without QAT plus the
    quantised input (up front it was also a quantised copy of every weight: w1 + w3 + w2, 3 x 32 KB here)."""
    from megatron_k3.planning.measure import LiveTensorMemory

    ex, z, offs = _experts(E=4, L=64, I=128)
    ex.to(dtype)
    z = z.to(dtype)
    g = torch.Generator().manual_seed(3)
    combine = replicas = None
    if path == "batched":
        z, offs = z[:16].reshape(4, 4, 64), None
    if path == "combine":
        M = z.shape[0]
        combine = (torch.rand(M, generator=g).requires_grad_(), torch.randint(0, 7, (M,), generator=g), 7)
    if path == "replicas":
        replicas = tuple((torch.randn(2, *w.shape[1:], generator=g) * 0.05).to(dtype).requires_grad_()
                         for w in (ex.w1, ex.w3, ex.w2))
        offs = torch.cat([offs, offs[-1:] + torch.tensor([3, 7])])  # every row in a group
        z = torch.cat([z, torch.randn(7, 64, generator=g).to(dtype)])
    ex.qat = ExpertQAT()
    leaves = [p for p in ex.parameters()] + [t for t in (combine or ())[:1]] + list(replicas or ())

    def run(fn):
        mem = LiveTensorMemory()
        with mem:  # the input counted alike in each run (a view of it would count it otherwise)
            x = z.clone().requires_grad_()
            y = fn(x)
        kept = mem.current
        y.backward(torch.ones_like(y) if y.dtype.is_floating_point else None)
        grads = [x.grad] + [t.grad.clone() for t in leaves]
        for t in leaves:
            t.grad = None
        return y.detach(), grads, kept

    if path == "replicas":
        got = run(lambda x: ex.forward_with(x, offs, replicas))
    elif path == "batched":
        got = run(lambda x: ex.forward_batched(x))
    else:
        got = run(lambda x: ex(x, offs, combine))
    want = run(lambda x: _up_front(ex, x, offs, combine, replicas))
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b)
    ex.qat = None
    plain = run(lambda x: ex.forward_with(x, offs, replicas) if path == "replicas" else
                ex.forward_batched(x) if path == "batched" else ex(x, offs, combine))
    quantised_input = z.numel() * z.element_size()
    weights = sum(p.numel() * p.element_size() for p in ex.parameters())
    assert got[2] <= plain[2] + quantised_input
    assert want[2] >= plain[2] + weights  # the up-front graph keeps a copy of every weight


def test_prepare_hooks_only_the_routed_experts(tiny):
    torch.manual_seed(0)
    model = K3ForCausalLM(tiny)
    n_params = {k: v.clone() for k, v in model.state_dict().items()}
    prepare_model_for_precision(model, MX_QAT)
    hooked = [n for n, m in model.named_modules() if getattr(m, "qat", None) is not None]
    assert hooked == [f"model.layers.{i}.mlp.experts" for i in range(tiny.first_k_dense, tiny.num_layers)]
    assert all(isinstance(model.get_submodule(n), GroupedExperts) for n in hooked)
    sd = model.state_dict()  # no parameters, buffers or keys added
    assert sd.keys() == n_params.keys() and all(torch.equal(sd[k], n_params[k]) for k in sd)
    assert autocast_dtype(MX_QAT) is torch.bfloat16
    with forward_context(MX_QAT, "cpu"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is torch.bfloat16
    with forward_context(PrecisionConfig(), "cpu"):
        assert not torch.is_autocast_enabled("cpu")
    enable_expert_qat(model, None)
    assert not any(getattr(m, "qat", None) for m in model.modules())


def test_mx_qat_trains_a_few_steps(tiny):
    torch.manual_seed(0)
    model = prepare_model_for_precision(K3ForCausalLM(tiny), MX_QAT)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, tiny.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    ctx = forward_context(MX_QAT, "cpu")
    losses = []
    for _ in range(4):
        with ctx:
            loss = model(ids, labels=ids.roll(-1, 1)).loss
        loss.backward()
        w1 = model.model.layers[1].mlp.experts.w1
        assert w1.grad is not None and w1.grad.abs().sum() > 0 and w1.dtype == torch.float32  # fp32 masters
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("autocast", [True, False])
def test_export_import_is_bit_exact(tiny, autocast):
    """QAT model -> K3 tensors -> a fresh model with the same other weights: its logits equal the QAT model's bit
    for bit, whether it re-quantises the imported weights (full QAT) or only the activations, and re-exporting
    gives the same bytes (dequantised MX weights are exactly representable, and quantisation is idempotent)."""
    torch.manual_seed(0)
    model = prepare_model_for_precision(K3ForCausalLM(tiny), MX_QAT)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, tiny.vocab_size, (2, 48), generator=torch.Generator().manual_seed(2))
    ctx = forward_context(MX_QAT if autocast else PrecisionConfig(name="mx_qat", dtype="fp32"), "cpu")
    with ctx:
        model(ids, labels=ids.roll(-1, 1)).loss.backward()
    opt.step()  # move the masters off their init
    with torch.no_grad(), ctx:
        ref = model(ids).logits
    exported = export_model_experts(model)
    E, I, L = tiny.num_experts, tiny.moe_intermediate_size, tiny.expert_width
    n_moe = tiny.num_layers - tiny.first_k_dense
    assert len(exported) == n_moe * E * 3 * 2
    k = f"model.layers.{tiny.first_k_dense}.block_sparse_moe.experts.{E - 1}"
    shapes = {n: tuple(exported[f"{k}.{n}"].shape) for n in ("w1.weight_packed", "w1.weight_scale",
                                                                "w2.weight_packed", "w2.weight_scale")}
    assert shapes == {"w1.weight_packed": (I, L // 2), "w1.weight_scale": (I, L // 32),
                      "w2.weight_packed": (L, I // 2), "w2.weight_scale": (L, I // 32)}
    assert all(t.dtype == torch.uint8 for t in exported.values())

    fresh = K3ForCausalLM(tiny)
    fresh.load_state_dict({k: v for k, v in model.state_dict().items()})
    used = import_model_experts(fresh, exported)
    assert sorted(used) == sorted(exported)
    for acts_only in (True, False):
        enable_expert_qat(fresh, ExpertQAT(weights=not acts_only))
        with torch.no_grad(), ctx:
            assert torch.equal(fresh(ids).logits, ref)
    again = export_model_experts(fresh)
    assert all(torch.equal(again[k], exported[k]) for k in exported)
    enable_expert_qat(fresh, None)  # without the activation fake-quant the logits do differ
    with torch.no_grad(), ctx:
        assert not torch.equal(fresh(ids).logits, ref)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (so -0 differs from +0), for fp32 and bf16."""
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


def _every_block_form(gen) -> tuple:
    """MXFP4 blocks of every form a checkpoint can hold: per top code 0..7 (either sign; 0 gives all-zero blocks, -0
    among them) and E8M0 scale 0..252 (the largest whose 6 * 2^(s - 127) fits fp32 and bf16), four random blocks
    whose other codes lie at or below the top. Returns (weight_packed [rows, 16], weight_scale [rows, 1])."""
    top = torch.arange(8).repeat_interleave(253 * 4)
    scale = torch.arange(253).repeat_interleave(4).repeat(8)
    mags = (torch.rand(len(top), 32, generator=gen) * (top + 1).unsqueeze(1)).long()  # in [0, top]
    mags[torch.arange(len(top)), torch.randint(0, 32, (len(top),), generator=gen)] = top
    codes = mags | (torch.randint(0, 2, mags.shape, generator=gen) << 3)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, scale.to(torch.uint8).unsqueeze(1)


@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_qat_weights_of_imported_mxfp4_experts_are_the_imported_values(tmp_path, scale_mode):
    """From the first SFT step (precision=mx_qat on a K3 checkpoint's experts) the fake-quantised weights are the
    imported ones bit for bit, in fp32 and in bf16 (mx_qat's module weights), with either scale mode: a K3 directory
    written by an independent MXFP4 encoder (tests/k3_reference.py, NeMo's ceil rule) and every block form. Our
    quantiser maps every MXFP4 value set to itself, though not always to the same codes (a block encoded with top
    code 3 is 6 at half the scale for us; export keeps the imported bytes: interop.k3_experts)."""
    import k3_reference as ref

    from megatron_k3.interop import load_hf

    ref.write_checkpoint(tmp_path, ref.random_checkpoint(seed=4))
    model = load_hf(tmp_path)
    weights = [getattr(m, n).detach() for m in model.modules() if isinstance(m, GroupedExperts)
               for n in ("w1", "w2", "w3")]
    packed, scale = _every_block_form(torch.Generator().manual_seed(0))
    weights.append(dequantize_k3_weight(packed, scale))  # as import decodes them
    ours = quantize_k3_weight(weights[-1], scale_mode)
    assert not torch.equal(ours[0], packed) and not torch.equal(ours[1], scale)  # other codes for the same values
    qat = ExpertQAT(weight_scale_mode=scale_mode)
    for w in weights:
        for dtype in (torch.float32, torch.bfloat16):
            assert _same_bits(qat.weight(w.to(dtype)), w.to(dtype))


def test_k3_layout_decodes_by_hand():
    """weight_packed / weight_scale decoded with the K3 rule written out: low nibble = even column, bit 3 = sign,
    w = LUT[code] * 2^(scale - 127) with one scale per 32 input columns."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 64, generator=g) * torch.tensor([1e-3, 1.0, 50.0]).unsqueeze(1)
    packed, scale = quantize_k3_weight(w)
    assert packed.shape == (3, 32) and scale.shape == (3, 2)
    lut = [0, .5, 1, 1.5, 2, 3, 4, 6]
    by_hand = torch.zeros(3, 64)
    for r in range(3):
        for c in range(64):
            byte = int(packed[r, c // 2])
            code = byte & 0xF if c % 2 == 0 else byte >> 4
            v = lut[code & 7] * (-1 if code & 8 else 1)
            by_hand[r, c] = v * 2.0 ** (int(scale[r, c // 32]) - 127)
    assert torch.equal(dequantize_k3_weight(packed, scale), by_hand)
    assert torch.equal(by_hand, fake_quant_mx(w, "e2m1"))
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_k3_weight(packed, scale[:, :1])


def test_import_reports_missing_and_mismatched(tiny):
    torch.manual_seed(0)
    exported = export_model_experts(K3ForCausalLM(tiny))
    key = next(iter(exported))
    missing = {k: v for k, v in exported.items() if k != key}
    with pytest.raises(KeyError, match=f"no {key}"):
        import_model_experts(K3ForCausalLM(tiny), missing)
    wide = dict(exported)  # an expert matrix twice as wide as the model's
    base = key.rsplit(".", 1)[0]
    wide[f"{base}.weight_packed"] = torch.cat([exported[f"{base}.weight_packed"]] * 2, 1)
    wide[f"{base}.weight_scale"] = torch.cat([exported[f"{base}.weight_scale"]] * 2, 1)
    with pytest.raises(ValueError, match="the model expects"):
        import_model_experts(K3ForCausalLM(tiny), wide)


def test_precision_config_validation(tiny):
    RunConfig(model=tiny, precision=MX_QAT).validate()
    bad = [
        (PrecisionConfig(name="mx_qat", dtype="fp32"), "precision.dtype"),
        (PrecisionConfig(name="int4", dtype="bf16"), "precision"),
        (PrecisionConfig(name="mx_qat", dtype="bf16", mx_act_format="e3m4"), "precision.mx_act_format"),
        (PrecisionConfig(name="mx_qat", dtype="bf16", mx_weight_scale_mode="even"), "precision.mx_weight_scale_mode"),
        (PrecisionConfig(name="mx_qat", dtype="bf16", mx_block_size=128), "model.moe_latent_size"),
    ]
    for pr, key in bad:
        with pytest.raises(ConfigError) as e:
            RunConfig(model=tiny, precision=pr).validate()
        assert e.value.key == key, (pr, e.value)
    for name in ("mx_qat", "te_fp8", "te_mxfp8", "bf16"):  # the YAML files compose onto the schema
        run, _, _ = compose_run_config([f"precision={name}"])
        assert run.precision.name == name and run.precision.dtype == "bf16"


def test_te_precisions_fail_clearly_without_gpu(tiny):
    """On a CPU machine te_fp8 / te_mxfp8 stop with one ConfigError line naming what is missing, without
    importing TransformerEngine."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: bench/gpu_check.py covers the TE paths")
    before = "transformer_engine" in sys.modules
    model = K3ForCausalLM(tiny)
    for name, sm in (("te_fp8", "9.0"), ("te_mxfp8", "10.0")):
        with pytest.raises(ConfigError) as e:
            prepare_model_for_precision(model, PrecisionConfig(name=name, dtype="bf16"))
        msg = str(e.value)
        assert "\n" not in msg and f"precision='{name}'" in msg and f"needs an SM >= {sm} GPU" in msg
        installed = importlib.util.find_spec("transformer_engine") is not None
        assert installed or "TransformerEngine is not installed" in msg
    assert ("transformer_engine" in sys.modules) == before
