"""Hugging Face interop: `megatron_k3.interop.load_hf` / `save_hf` in the Kimi Linear and Kimi K3 layouts.

Kimi Linear: transformers builds a model and writes its checkpoint directory (tests/hf_reference.py, one subprocess
with fla blocked); we import it, compare logits, export it, and a second subprocess loads our export back into
transformers. Kimi K3: tests/k3_reference.py, an independent writer + plain-torch forward that imports nothing
from megatron_k3, writes a K3-layout checkpoint with MXFP4 experts; we import it and match its logits, then export
and re-import bit for bit.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path
from types import SimpleNamespace

import k3_reference as ref
import pytest
import torch
from helpers import load_file, max_abs_rel, run_hf_reference

from megatron_k3.config import ConfigError, load_model_config
from megatron_k3.interop import load_hf, save_hf
from megatron_k3.interop.hf import ConfigMismatchError, config_differences, read_checkpoint
from megatron_k3.interop.k3_layout import k3_config_to
from megatron_k3.interop.kimi_linear import hf_config_from, hf_config_to
from megatron_k3.model import K3ForCausalLM

HAVE_KIMI_LINEAR = importlib.util.find_spec("transformers.models.kimi_linear") is not None
RTOL_FP32 = 1e-4  # fp32 against a reference: measured ~1e-6 (Kimi Linear) and ~8e-6 (K3)
RTOL_FP64 = 1e-10  # float64 on both sides: the same math, so only rounding of the order of 1e-14 remains


def _files(path) -> dict:
    return read_checkpoint(path)[1]


# ------------------------------------------------------------------------------------------------ Kimi Linear
@pytest.fixture(scope="module")
def kl(tmp_path_factory):
    """transformers' checkpoint of a tiny Kimi Linear (q compression, MLA at layers 2 and 4), our import of it,
    our export, and transformers' run on our export."""
    if not HAVE_KIMI_LINEAR:  # pragma: no cover
        pytest.skip("transformers lacks transformers.models.kimi_linear")

    d = tmp_path_factory.mktemp("kimi_linear")
    cfg = load_model_config("kimi_linear_tiny", ["q_lora_rank=24", "mla_layers=[2,4]"])
    ids = torch.randint(0, cfg.vocab_size, (2, 77), generator=torch.Generator().manual_seed(11))
    (d / "run1").mkdir()
    state, logits, info = run_hf_reference(d / "run1", hf_config_from(cfg), 3, ids, save_pretrained=str(d / "hf"))
    model = load_hf(d / "hf").eval()
    save_hf(model, d / "ours", layout="kimi_linear")
    (d / "run2").mkdir()
    state2, logits2, info2 = run_hf_reference(d / "run2", {}, 0, ids, load_from=str(d / "ours"))
    return SimpleNamespace(d=d, cfg=cfg, ids=ids, state=state, logits=logits, info=info, model=model,
                           state2=state2, logits2=logits2, info2=info2)


@pytest.mark.slow
def test_kimi_linear_import_matches_transformers(kl):
    assert config_differences(kl.cfg, kl.model.cfg) == {}
    with torch.no_grad():
        err = max_abs_rel(kl.model(kl.ids).logits, kl.logits)
    print(f"Kimi Linear from_hf logits vs transformers: {err:.2e}")
    assert err < RTOL_FP32


def _dense_quirk(key: str, cfg) -> str:
    """transformers 5.x writes a dense layer's MLP under block_sparse_moe.; the published checkpoint says mlp."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.weight", key)
    if m and cfg.ffn_types()[int(m.group(1))] == "dense":
        return f"model.layers.{m.group(1)}.mlp.{m.group(2)}.weight"
    return key


@pytest.mark.slow
def test_kimi_linear_export_is_bit_identical(kl):
    theirs, ours = _files(kl.d / "hf"), _files(kl.d / "ours")
    renamed = {_dense_quirk(k, kl.cfg): v for k, v in theirs.items()}
    assert len([k for k in theirs if _dense_quirk(k, kl.cfg) != k]) == 3 * kl.cfg.first_k_dense
    assert sorted(ours) == sorted(renamed)
    for k, v in renamed.items():
        assert ours[k].dtype == v.dtype and torch.equal(ours[k], v), k
    # config.json: ours reads back as the same model, and transformers read it as the same config
    assert config_differences(kl.cfg, hf_config_to(json.loads((kl.d / "ours" / "config.json").read_text()))) == {}
    assert kl.info2["config"] == kl.info["config"]


@pytest.mark.slow
def test_transformers_loads_our_export(kl):
    """transformers' from_pretrained on our directory: no missing/unexpected keys (checked in the subprocess), the
    same in-memory tensors as the model it started from, and the same logits."""
    assert sorted(kl.state2) == sorted(kl.state)
    for k, v in kl.state.items():
        assert torch.equal(kl.state2[k], v), k
    assert max_abs_rel(kl.logits2, kl.logits) < 1e-6


def test_kimi_linear_config_refusals():
    base = json.loads(json.dumps(hf_config_from(load_model_config("kimi_linear_tiny"))))
    assert config_differences(load_model_config("kimi_linear_tiny"), hf_config_to(base)) == {}
    for key, value in [("hidden_act", "gelu"), ("moe_layer_freq", 2), ("num_key_value_heads", 1),
                       ("mlp_layer_types", ["sparse", "dense", "sparse", "sparse"]), ("model_type", "llama")]:
        with pytest.raises(ConfigError, match=key):
            hf_config_to({**base, key: value})


# ------------------------------------------------------------------------------------------------ Kimi K3
@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3")
    tensors = ref.random_checkpoint(seed=0)
    ref.write_checkpoint(d / "ref", tensors)
    ids = torch.randint(0, ref.TEXT_CONFIG["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(5))
    model = load_hf(d / "ref").eval()  # layout detected from config.json
    save_hf(model, d / "export_a", layout="k3")
    return SimpleNamespace(d=d, tensors=tensors, ids=ids, logits=ref.forward(tensors, ids), model=model)


def test_k3_export_keeps_the_imported_encoding_only_where_values_did_not_change(k3):
    """Blocks the reference encoded at a non-canonical scale keep it; a changed block gets the canonical encoding."""
    import copy

    from megatron_k3.interop.k3_experts import quantize_k3_weight

    theirs = _files(k3.d / "ref")
    experts = next(m for n, m in k3.model.named_modules() if n.endswith("mlp.experts"))
    layer = next(n for n, m in k3.model.named_modules() if m is experts).split(".")[2]
    key = f"{ref.PREFIX}model.layers.{layer}.block_sparse_moe.experts.0.w1"
    canonical = quantize_k3_weight(experts.w1[0])[1]
    differs = canonical != theirs[key + ".weight_scale"]
    assert differs.any()  # the reference did encode some blocks differently: the case is exercised
    model = copy.deepcopy(k3.model)
    moved = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
    # a block the reference encoded at scale s (top code 3) that holds a zero: set that zero to 2^(s-2), which
    # scale s cannot encode but the canonical s-1 can (code 0.5): the block changed and is re-encoded
    r, b, j = next((int(r), int(b), int(z[0])) for r, b in differs.nonzero()
                   for z in [(moved.w1[0, r, 32 * b:32 * b + 32] == 0).nonzero().flatten()] if len(z))
    s_ref = int(theirs[key + ".weight_scale"][r, b]) - 127
    with torch.no_grad():
        moved.w1[0, r, 32 * b + j] = 2.0 ** (s_ref - 2)
    save_hf(model, k3.d / "export_changed", layout="k3")
    got = _files(k3.d / "export_changed")[key + ".weight_scale"]
    want = quantize_k3_weight(moved.w1[0])[1]
    assert got[r, b] == want[r, b] != theirs[key + ".weight_scale"][r, b]
    keep = torch.ones_like(differs)
    keep[r, b] = False
    assert torch.equal(got[keep], theirs[key + ".weight_scale"][keep])


def test_k3_import_reproduces_independent_logits(k3):
    assert dataclasses.asdict(k3.model.cfg) == dataclasses.asdict(load_hf(k3.d / "ref", "k3").cfg)
    with torch.no_grad():
        err32 = max_abs_rel(k3.model(k3.ids).logits, k3.logits)
        model64 = load_hf(k3.d / "ref").double().eval()
        err64 = max_abs_rel(model64(k3.ids).logits, k3.logits)
        # negative control: two routed experts of one layer swapped
        w1 = model64.model.layers[2].mlp.experts.w1
        w1[[0, 1]] = w1[[1, 0]]
        err_control = max_abs_rel(model64(k3.ids).logits, k3.logits)
    print(f"K3 from_hf vs independent reference: fp32 {err32:.2e}, fp64 {err64:.2e} (control {err_control:.2e})")
    assert err32 < RTOL_FP32
    assert err64 < RTOL_FP64
    assert err_control > 100 * RTOL_FP32


def test_k3_export_reimports_bit_identically(k3):
    a, b = k3.d / "export_a", k3.d / "export_b"
    again = load_hf(a)
    for k, v in k3.model.state_dict().items():  # every exported value was representable: nothing moved
        assert torch.equal(again.state_dict()[k], v), k
    save_hf(again, b, layout="k3", max_shard_size=100_000)  # sharded, with an index
    assert (b / "model.safetensors.index.json").is_file() and len(list(b.glob("model-*.safetensors"))) > 1
    ta, tb = _files(a), _files(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:  # packed MXFP4 bytes and E8M0 scales included
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    # against the independent writer: the same bytes, MXFP4 included. Its ceil rule encodes some blocks at another
    # scale than ours would (top code 3 or 4, the same values as 6 or 8 at half the scale); import keeps each block's
    # scale and export reuses it while it still encodes the block exactly (interop.k3_experts)
    theirs = {k[len(ref.PREFIX):]: v for k, v in _files(k3.d / "ref").items()}
    ours = {k[len(ref.PREFIX):]: v for k, v in ta.items()}
    assert sorted(ours) == sorted(theirs)
    for k, v in theirs.items():
        assert ours[k].dtype == v.dtype and ours[k].shape == v.shape and torch.equal(ours[k], v), k
    cfg_a = json.loads((a / "config.json").read_text())
    assert "megatron_k3" not in cfg_a["text_config"]
    assert config_differences(k3.model.cfg, k3_config_to(cfg_a)) == {}


def test_k3_layout_details(k3):
    """The padded fp32 A_log, fp32 conv / decay / norm / router-bias tensors, bf16 elsewhere, U8 experts."""
    t = _files(k3.d / "export_a")
    H = ref.TEXT_CONFIG["linear_attn_config"]["num_heads"]
    a_log = t["language_model.model.layers.0.self_attn.A_log"]
    assert a_log.shape == (128,) and a_log.dtype == torch.float32 and not a_log[H:].any()
    assert torch.equal(a_log[:H], k3.model.model.layers[0].self_attn.A_log.detach())
    for k, v in t.items():
        fp32 = k.endswith((".A_log", ".dt_bias", "_conv1d.weight", ".o_norm.weight", ".e_score_correction_bias"))
        want = torch.uint8 if ".experts." in k else torch.float32 if fp32 else torch.bfloat16
        assert v.dtype == want, k


def test_k3_extension_keys_round_trip(tmp_path):
    """Values the K3 config has no key for (an MLA latent-norm eps other than the released 1e-6, k3_tiny's shared
    experts 128 wide): they travel under text_config["megatron_k3"], and export -> import -> export is
    bit-identical."""
    cfg = load_model_config("k3_tiny", ["mla_latent_norm_eps=1e-5"])
    torch.manual_seed(0)
    save_hf(K3ForCausalLM(cfg), tmp_path / "a")
    text = json.loads((tmp_path / "a" / "config.json").read_text())["text_config"]
    assert text["megatron_k3"] == {"mla_latent_norm_eps": cfg.mla_latent_norm_eps,
                                   "shared_intermediate_size": cfg.shared_ffn_size}
    back = load_hf(tmp_path / "a", config=cfg)
    save_hf(back, tmp_path / "b")
    ta, tb = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_config_mismatch_names_the_keys(k3):
    good = k3.model.cfg
    load_hf(k3.d / "ref", config=dataclasses.replace(good, moe_overflow="drop"))  # not architectural
    bad = dataclasses.replace(good, num_experts=16, top_k=4, name="mine")
    with pytest.raises(ConfigMismatchError) as e:
        load_hf(k3.d / "ref", config=bad)
    assert e.value.differences == {"num_experts": (16, 8), "top_k": (4, 2)}
    assert "num_experts" in str(e.value) and "top_k" in str(e.value)


def test_k3_refusals(tmp_path):
    text = dict(ref.TEXT_CONFIG)
    for key, value in [("moe_layer_freq", 2), ("num_nextn_predict_layers", 1), ("hidden_act", "silu"),
                       ("moe_router_activation_func", "softmax"), ("activation_situ_linear_beta", None)]:
        with pytest.raises(ConfigError, match=key):
            k3_config_to({"model_type": "kimi_k3", "text_config": {**text, key: value}})
    tensors = dict(ref.random_checkpoint(seed=1))
    a_log = tensors["model.layers.0.self_attn.A_log"].clone()
    a_log[-1] = 0.5  # the padding must be zero
    tensors["model.layers.0.self_attn.A_log"] = a_log
    ref.write_checkpoint(tmp_path / "bad", tensors)
    with pytest.raises(ValueError, match="A_log"):
        load_hf(tmp_path / "bad")
    with pytest.raises(ConfigError, match="hidden_act"):
        save_hf(K3ForCausalLM(load_model_config("kimi_linear_tiny")), tmp_path / "x", layout="k3")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": text}))
        load_hf(tmp_path / "empty")



def test_convert_checkpoint_hf_cli(tmp_path, capsys):
    """tools/convert_checkpoint.py: our unsharded weights -> a K3 directory (sharded, with an index) -> a step-0
    training checkpoint holding the K3-exported values and the model config; a weights file without a model name is
    refused with one line."""

    from safetensors.torch import save_file

    from megatron_k3.training import checkpoint as ckpt

    tool = Path(__file__).resolve().parent.parent / "tools" / "convert_checkpoint.py"
    cli = load_file(tool)
    cfg = load_model_config("k3_tiny", ["num_layers=4"])
    torch.manual_seed(0)
    save_file({k: v.contiguous() for k, v in K3ForCausalLM(cfg).state_dict().items()}, str(tmp_path / "ours.st"))
    assert cli.main([str(tmp_path / "ours.st"), str(tmp_path / "hf"), "--to-hf", "model=k3_tiny",
                     "model.num_layers=4", "--max-shard-size", "200000"]) == 0
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert cli.main([str(tmp_path / "hf"), str(tmp_path / "back"), "--from-hf"]) == 0
    step0 = ckpt.resolve_load_path("auto", tmp_path / "back")
    back, _, _ = ckpt.read_full(step0)
    expected = load_hf(tmp_path / "hf").state_dict()
    assert sorted(back) == sorted(expected) and all(torch.equal(back[k], v) for k, v in expected.items())
    saved_cfg = ckpt.read_meta(step0)["model"]
    assert saved_cfg["num_layers"] == 4 and saved_cfg["mla_latent_norm_eps"] == cfg.mla_latent_norm_eps
    capsys.readouterr()
    assert cli.main([str(tmp_path / "ours.st"), str(tmp_path / "hf2"), "--to-hf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "model=NAME" in err[0]
