"""Fine-tuning from the released weights (issue 34): `model=from_checkpoint` composes the model from checkpoint.load's
config.json (a Kimi K3 or Kimi Linear directory, text or vision-language) with one-line errors; a K3 directory whose
config.json carries a vision_config around a text model (as NeMo writes a tiny text-only K3) loads as text; and a run
that starts from a K3 directory with MXFP4 experts under precision=mx_qat exports the released layout back:
untouched tensors byte for byte, the tokenizer files copied, and an independent reader (safetensors + torch, its own
MXFP4 decoding, tests/k3_reference.py's plain-torch forward) reproduces our logits.

The tiny K3 directories are tests/k3_reference.py's (NeMo's MXFP4 rule: scale 2^ceil(log2(amax / 6)), so some blocks
carry top code 3 or 4, which our own quantiser would encode at half the scale).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import k3_reference as ref
import k3_vl_reference as vlref
import pytest
import torch
from dist_utils import run_distributed
from helpers import max_abs_rel
from safetensors import safe_open

from megatron_k3.config import ConfigError, DataConfig, compose_run_config, load_model_config
from megatron_k3.interop import checkpoint_model_config, load_hf, save_hf
from megatron_k3.interop.hf import config_differences
from megatron_k3.model import K3ForCausalLM
from megatron_k3.precision import ExpertQAT, enable_expert_qat

RELEASED_PLACEHOLDER = 163605  # the released K3's media_placeholder_token_id
# the tokenizer and chat files of a K3 directory (contents arbitrary: they are copied, not read)
TOKENIZER = {"tiktoken.model": b"aGVsbG8= 0\nd29ybGQ= 1\n", "tokenizer_config.json": b'{"model_max_length": 64}\n',
             "tokenization_kimi.py": b"# the release's tokenizer class\n", "chat_template.jinja": b"{{ messages }}\n"}
# 1e-4 relative (largest logit difference over the largest logit): our model in fp32 against the reader's forward in
# float64 on the same exported values; test_interop measures ~8e-6 for this pair. A wrong code, scale or nibble order
# moves the logits by more than 1e-2.
RTOL_FP32 = 1e-4


def _compose(overrides):
    return compose_run_config(["model=from_checkpoint"] + overrides, model_reader=checkpoint_model_config)[0]


def _text_k3_dir(path: Path, vocab_size: int = ref.TEXT_CONFIG["vocab_size"], vision_config: bool = False) -> dict:
    """tests/k3_reference.py's tiny K3 (MXFP4 experts) in `path`, with the tokenizer files; vision_config=True: its
    config.json also carries the released vision_config (placeholder 163605) but the directory no vision tensors,
    as NeMo writes a tiny text-only K3. Returns the text config."""
    text = dict(ref.TEXT_CONFIG, vocab_size=vocab_size)
    ref.write_checkpoint(path, ref.random_checkpoint(text, seed=0), text)
    if vision_config:
        config = json.loads((path / "config.json").read_text())
        vision = dict(vlref.VISION_CONFIG, media_placeholder_token_id=RELEASED_PLACEHOLDER)
        config.update(vision_config=vision, media_placeholder_token_id=RELEASED_PLACEHOLDER)
        (path / "config.json").write_text(json.dumps(config))
    for name, data in TOKENIZER.items():
        (path / name).write_bytes(data)
    return text


# ------------------------------------------------------------------------------------------------ the vision config
def test_a_text_load_ignores_the_vision_config_of_a_directory_without_vision_tensors(tmp_path, caplog):
    """The failure this fixes: load_hf(vision=False) of such a directory raised `placeholder_token_id=163605: must be
    a token id below model.vocab_size=512` (the released vision_config checked against the tiny vocabulary)."""
    _text_k3_dir(tmp_path, vision_config=True)
    text = load_hf(tmp_path, vision=False)
    assert type(text) is K3ForCausalLM and not text.cfg.vision.enabled
    with caplog.at_level(logging.INFO, logger="megatron_k3"):
        auto = load_hf(tmp_path)  # no vision tensors: the text model, said in one line
    assert type(auto) is K3ForCausalLM and not auto.cfg.vision.enabled
    assert [r for r in caplog.records if "holds no vision-tower tensors" in r.getMessage()]
    assert all(torch.equal(a, b) for a, b in zip(text.state_dict().values(), auto.state_dict().values()))
    with pytest.raises(ConfigError, match="placeholder_token_id=163605: must be a token id below"):
        load_hf(tmp_path, vision=True)  # asked for the tower: its config is checked


# ------------------------------------------------------------------------------------------------ model=from_checkpoint
def test_from_checkpoint_takes_the_shapes_of_config_json(tmp_path):
    """Text K3 (also one with NeMo's vision_config and no tower), vision-language K3 and Kimi Linear directories: the
    composed model is config.json's, the runtime keys given beside it apply, and what --cfg records is the same."""
    _text_k3_dir(tmp_path / "k3", vision_config=True)
    vlref.write_vl_checkpoint(tmp_path / "vl", vlref.random_vl_checkpoint(seed=0))
    kl = load_model_config("kimi_linear_tiny")
    torch.manual_seed(0)
    save_hf(K3ForCausalLM(kl), tmp_path / "kl", layout="kimi_linear")
    for name, vision in (("k3", False), ("vl", True), ("kl", False)):
        run, cfg, _ = compose_run_config(["model=from_checkpoint", f"checkpoint.load={tmp_path / name}",
                                          "model.moe_overflow=drop"], model_reader=checkpoint_model_config)
        m = run.model
        assert m.name == "from_checkpoint" and m.moe_overflow == "drop" and m.vision.enabled is vision, name
        assert config_differences(m, load_hf(tmp_path / name).cfg) == {}, name
        assert cfg.model.hidden_size == m.hidden_size and cfg.model.vision.enabled is vision
    assert config_differences(run.model, kl) == {}


def test_from_checkpoint_errors_are_one_line_naming_the_key(tmp_path):
    _text_k3_dir(tmp_path / "k3")
    (tmp_path / "plain").mkdir()
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "silu").mkdir()
    (tmp_path / "silu" / "config.json").write_text(json.dumps(
        {"model_type": "kimi_k3", "text_config": dict(ref.TEXT_CONFIG, hidden_act="silu")}))
    cases = [
        ([], "checkpoint.load='auto'"),
        (["checkpoint.load=none"], "checkpoint.load='none'"),
        ([f"checkpoint.load={tmp_path / 'none'}"], "no such directory"),
        ([f"checkpoint.load={tmp_path / 'plain'}"], f"no {tmp_path / 'plain' / 'config.json'}"),
        ([f"checkpoint.load={tmp_path / 'llama'}"], f"{tmp_path / 'llama' / 'config.json'}: model_type 'llama'"),
        ([f"checkpoint.load={tmp_path / 'silu'}"], f"{tmp_path / 'silu' / 'config.json'}:hidden_act='silu'"),
        ([f"checkpoint.load={tmp_path / 'k3'}", "model.hidden_size=64"], "model.hidden_size='64'"),
        ([f"checkpoint.load={tmp_path / 'k3'}", "model.vision.enabled=true"], "model.vision.enabled='true'"),
        ([f"checkpoint.load={tmp_path / 'k3'}", "model.freeze_vision=true"], "model.freeze_vision=True"),
    ]
    for overrides, says in cases:
        with pytest.raises(ConfigError) as e:
            _compose(overrides)
        assert says in str(e.value) and "\n" not in str(e.value), (overrides, str(e.value))
    with pytest.raises(ConfigError, match="without a checkpoint reader"):
        compose_run_config(["model=from_checkpoint", f"checkpoint.load={tmp_path / 'k3'}"])
    with pytest.raises(ConfigError, match="model='from_checkpoint': its shapes come from checkpoint.load"):
        load_model_config("from_checkpoint")


@pytest.mark.slow
def test_the_entry_point_composes_from_checkpoint(tmp_path, capsys):
    """megatron_k3.train reads the directory (interop imported only for this) and --cfg prints its model."""
    from megatron_k3.train import main

    _text_k3_dir(tmp_path / "k3", vision_config=True)
    assert main(["model=from_checkpoint", f"checkpoint.load={tmp_path / 'k3'}", "--cfg"]) == 0
    out = capsys.readouterr().out
    assert "name: from_checkpoint" in out and f"vocab_size: {ref.TEXT_CONFIG['vocab_size']}" in out
    assert main(["model=from_checkpoint", "model.num_layers=2", f"checkpoint.load={tmp_path / 'k3'}"]) == 2
    assert "model.num_layers='2'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ SFT and export
# one sequence of 32 tokens a step, AdamW, the embedded corpus (its tokenizer's ids fit the directory's vocabulary)
SFT = ["model=from_checkpoint", "precision=mx_qat", "train.steps=1", "train.seq_length=32", "train.micro_batch_size=1",
       "train.global_batch_size=1", "train.eval_interval=0", "optim=adamw", "optim.lr=1e-3",
       "logging.wandb.mode=disabled"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int16 if t.element_size() == 2 else torch.int32)


@torch.no_grad()
def _logits_with_qat_weights(model, ids, masters: dict):
    """Our model's logits in fp32 with the expert weights as the QAT forward uses them (fake-quantised MXFP4, the
    values the export writes) and `masters` (the fp32 masters of the tensors the layout stores in fp32) in place of
    their bf16 module weights, activations unquantised: what an MXFP4 checkpoint of these weights computes."""
    m = K3ForCausalLM(model.cfg, init=False).eval()
    m.load_state_dict({k: masters.get(k, v).float() for k, v in model.state_dict().items()})
    enable_expert_qat(m, ExpertQAT(activations=False))
    return m(ids).logits


def _sft_worker(rank, world, src, out, ids, overrides):
    """From `src` under precision=mx_qat + `overrides`: whether the QAT weights equal the imported ones bit for bit
    at step 0, an export before any step (out/step0); with `ids`, one step, an export (out/step1) and our logits of
    `ids` then."""
    from megatron_k3.training.engine import shutdown
    from megatron_k3.training.loop import Trainer

    overrides = SFT + overrides + [f"checkpoint.load={src}", f"checkpoint.export_hf={out}/step0",
                                   f"checkpoint.dir={out}/ckpt"]
    run = compose_run_config(overrides, world_size=world, model_reader=checkpoint_model_config)[0]
    try:
        t = Trainer(run, f"{out}/run")
        t.maybe_resume()  # the weights of src, step 0
        experts = [m for m in t.model.modules() if getattr(m, "qat", None) is not None]
        identity = [torch.equal(_bits(m.qat.weight(getattr(m, n))), _bits(getattr(m, n)))
                    for m in experts for n in ("w1", "w2", "w3")]
        t.checkpoints.export_hf()
        if ids is None:
            return identity, None
        t.train_step()
        run.checkpoint.export_hf = f"{out}/step1"
        t.checkpoints.export_hf()
        return identity, _logits_with_qat_weights(t.model, ids, t.checkpoints.export_masters())
    finally:
        shutdown()


def _read_directory(path: Path) -> dict:
    """Every tensor of a Hugging Face directory, by name, read with safetensors alone."""
    files = sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())) \
        if (path / "model.safetensors.index.json").is_file() else ["model.safetensors"]
    out = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor, low_first: bool = True) -> torch.Tensor:
    """compressed-tensors mxfp4-pack-quantized, from its definition: two E2M1 codes per byte, the even column in the
    low nibble, bit 3 the sign, magnitude E2M1[code & 7]; one E8M0 scale per 32 columns, 2^(scale - 127).
    low_first=False: the nibbles the wrong way round (the negative control)."""
    nibbles = [packed & 0xF, packed >> 4]
    codes = torch.stack(nibbles if low_first else nibbles[::-1], -1).reshape(packed.shape[0], -1).long()
    values = E2M1[codes & 7] * (1 - 2 * (codes >> 3)).double()
    return values * torch.exp2(scale.double() - 127).repeat_interleave(32, 1)


def _independent_logits(path: Path, ids: torch.Tensor, low_first: bool = True) -> torch.Tensor:
    """The exported directory read and run without megatron_k3: experts decoded here, the text model's forward
    tests/k3_reference.py's (float64)."""
    tensors = _read_directory(path)
    dense = {}
    for k, v in tensors.items():
        name = k[len(ref.PREFIX):]
        if name.endswith(".weight_packed"):
            dense[name[:-len(".weight_packed")]] = _decode_mxfp4(v, tensors[k[:-len("packed")] + "scale"], low_first)
        elif not name.endswith(".weight_scale"):
            dense[name] = v
    text = json.loads((path / "config.json").read_text())["text_config"]
    return ref.forward(dense, ids, text)


@pytest.mark.slow
def test_sft_from_the_released_layout_under_qat_exports_it_back(tmp_path):
    """Import (model=from_checkpoint, precision=mx_qat) -> export before any step: every tensor byte for byte (the
    MXFP4 codes and scales, the bf16 tensors, and the fp32 ones, which mx_qat's bf16 module weights would round:
    their fp32 masters are set from the file and exported), the tokenizer files copied; at step 0 the QAT weights
    are the imported ones bit for bit. After a step the export is read by the independent reader, whose logits are
    ours; the fp32 tensors moved by less than bf16 can hold."""
    src, out = tmp_path / "k3", tmp_path / "out"
    _text_k3_dir(src, vocab_size=DataConfig().tokenizer_vocab_size + 64)
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(3))
    identity, ours = run_distributed(_sft_worker, 1, str(src), str(out), ids, [], timeout=300)[0]
    assert len(identity) == 3 * (ref.TEXT_CONFIG["num_hidden_layers"] - 1) and all(identity)
    theirs, step0 = (_read_directory(p) for p in (src, out / "step0"))
    assert sorted(step0) == sorted(theirs)
    fp32 = [k for k, v in theirs.items() if v.dtype == torch.float32 and not k.endswith(".e_score_correction_bias")]
    assert all(any(k.endswith(end) for k in fp32) for end in (".A_log", ".dt_bias", "_conv1d.weight", ".o_norm.weight"))
    for k, v in theirs.items():
        assert step0[k].dtype == v.dtype and torch.equal(_raw(step0[k]), _raw(v)), k
    for step in (out / "step0", out / "step1"):
        assert {n: (step / n).read_bytes() for n in TOKENIZER} == TOKENIZER
    step1 = _read_directory(out / "step1")
    assert [k for k in theirs if ".experts." not in k and not torch.equal(step1[k], step0[k])]  # the step trained
    # AdamW's first step moves each fp32 tensor by about lr = 1e-3: kept, where bf16 would have rounded it away
    assert any(not torch.equal(step1[k].bfloat16().float(), step1[k]) for k in fp32)
    err = max_abs_rel(ours.double(), _independent_logits(out / "step1", ids))
    control = max_abs_rel(ours.double(), _independent_logits(out / "step1", ids, low_first=False))
    print(f"independent reader of the trained export vs our fp32 logits: {err:.1e} (tolerance {RTOL_FP32}; "
          f"nibbles swapped: {control:.1e})")
    assert err < RTOL_FP32 < control / 100


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)
