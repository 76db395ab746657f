"""Parity with Hugging Face Kimi Linear: our model configured as Kimi Linear, loaded with the weights of a randomly
initialised `transformers` `KimiLinearForCausalLM`, gives the same logits (fp32, 1e-4 relative).

The reference runs in a subprocess (tests/hf_reference.py) in which `fla` cannot be imported, so transformers
uses its own PyTorch ops on the CPU instead of fla's Triton kernels. The HF -> ours weight mapping lives here.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_k3.config import load_model_config
from megatron_k3.model import K3ForCausalLM

if importlib.util.find_spec("transformers.models.kimi_linear") is None:  # pragma: no cover
    pytest.skip("transformers lacks transformers.models.kimi_linear", allow_module_level=True)

REFERENCE = Path(__file__).with_name("hf_reference.py")
RTOL = 1e-4


def hf_config_from(cfg) -> dict:
    """KimiLinearConfig kwargs equivalent to our ModelConfig (which must use the Kimi Linear switches)."""
    kimi_linear_switches = {
        "attn_res": False, "hidden_act": "silu", "kda_gate": "softplus", "kda_output_gate": "lowrank",
        "kda_output_gate_bias": False, "mla_output_gate": False, "moe_latent_size": 0, "moe_latent_norm": False,
        "router_num_groups": 1, "router_topk_groups": 1, "router_force_balanced": False,
        "tie_word_embeddings": False,
        "mla_latent_norm_eps": 1e-6,  # HF builds q_a_layernorm / kv_a_layernorm with the default eps 1e-6
    }
    for k, v in kimi_linear_switches.items():
        assert getattr(cfg, k) == v, f"{k}={getattr(cfg, k)!r}; Kimi Linear needs {v!r}"
    assert cfg.decay_rank == cfg.kda_head_dim  # HF: f_a_proj [head_dim, D]
    assert cfg.shared_ffn_size == cfg.moe_intermediate_size * cfg.num_shared_experts
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "rms_norm_eps": cfg.rms_norm_eps,
        "initializer_range": cfg.initializer_range,
        "intermediate_size": cfg.dense_intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "n_shared_experts": cfg.num_shared_experts,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob,
        "n_group": 1,
        "topk_group": 1,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank or None,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "num_attention_heads": cfg.mla_num_heads,
        "num_key_value_heads": cfg.mla_num_heads,
        "linear_num_heads": cfg.kda_num_heads,
        "linear_head_dim": cfg.kda_head_dim,
        "linear_conv_kernel_dim": cfg.kda_conv_size,
        "hidden_act": "silu",
        "layer_types": [{"mla": "full_attention", "kda": "linear_attention"}[t] for t in cfg.layer_types()],
        "mlp_layer_types": [{"dense": "dense", "moe": "sparse"}[t] for t in cfg.ffn_types()],
        "tie_word_embeddings": False,
        # the default token ids (163xxx) lie outside a tiny vocabulary; padding_idx must not touch the embedding
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    }


def map_hf_state_dict(hf: dict, cfg) -> dict:
    """HF KimiLinearForCausalLM state dict -> K3ForCausalLM state dict. Every HF key must be consumed."""
    hf = dict(hf)
    out = {}

    def take(hf_key, our_key=None, fn=None):
        t = hf.pop(hf_key)
        out[our_key or hf_key] = fn(t) if fn else t

    HK, I = cfg.kda_num_heads * cfg.kda_head_dim, cfg.moe_intermediate_size
    for i, (mixer, ffn) in enumerate(zip(cfg.layer_types(), cfg.ffn_types())):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if mixer == "kda":
            for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"):
                take(f"{a}{n}.weight")
            conv = hf.pop(a + "conv1d.weight")  # [3*H*K, 1, W]: q, k, v channels in that order
            assert conv.shape == (3 * HK, 1, cfg.kda_conv_size), conv.shape
            for j, n in enumerate(("q_conv1d", "k_conv1d", "v_conv1d")):
                out[a + n] = conv[j * HK:(j + 1) * HK].clone()
            for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias"):
                take(a + "forget_gate." + n, a + n)
            take(a + "forget_gate.A_log", a + "A_log", lambda t: t.reshape(-1))  # [1, 1, H, 1] -> [H]
            take(a + "o_norm.weight", a + "o_norm")
        else:
            names = ["q_a_proj", "q_a_layernorm", "q_b_proj"] if cfg.q_lora_rank else ["q_proj"]
            for n in names + ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]:
                take(f"{a}{n}.weight")
        m = p + "mlp."
        if ffn == "dense":
            for n in ("gate_proj", "up_proj", "down_proj"):
                take(f"{m}{n}.weight")
        else:
            take(m + "gate.weight")
            take(m + "gate.e_score_correction_bias")
            gate_up = hf.pop(m + "experts.gate_up_proj")  # [E, 2I, D]: gate rows, then up rows
            assert gate_up.shape[1] == 2 * I, gate_up.shape
            out[m + "experts.w1"] = gate_up[:, :I].clone()
            out[m + "experts.w3"] = gate_up[:, I:].clone()
            take(m + "experts.down_proj", m + "experts.w2")  # [E, D, I]
            for n in ("gate_proj", "up_proj", "down_proj"):
                take(f"{m}shared_experts.{n}.weight")
        take(p + "input_layernorm.weight")
        take(p + "post_attention_layernorm.weight")
    for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        take(k)
    assert not hf, f"HF keys left unmapped: {sorted(hf)}"
    return out


def run_reference(tmp_path: Path, hf_config: dict, seed: int, input_ids: torch.Tensor):
    from safetensors.torch import load_file

    spec = {"config": hf_config, "seed": seed, "input_ids": input_ids.tolist(), "out_dir": str(tmp_path)}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(REFERENCE), str(spec_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"hf_reference.py failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    info = json.loads((tmp_path / "info.json").read_text())
    return load_file(tmp_path / "state.safetensors"), load_file(tmp_path / "logits.safetensors")["logits"], info


CASES = {
    # the yaml as is: KDA, KDA, KDA, MLA; layer 0 dense, the rest MoE; T not a multiple of the 64-token chunk
    "tiny": dict(overrides=[], seed=0, batch=2, seq=100),
    # 6 layers with MLA at 3 and 6, a longer sequence (three chunks, the last partial), another seed
    "6layers_T130": dict(overrides=["num_layers=6", "mla_layers=[3,6]", "first_k_dense=2"], seed=1, batch=2,
                         seq=130),
    # the q_a_proj / q_a_layernorm / q_b_proj path of MLA
    "q_lora": dict(overrides=["q_lora_rank=24", "mla_layers=[2,4]"], seed=2, batch=1, seq=77),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf_kimi_linear(case, tmp_path, rel):
    c = CASES[case]
    cfg = load_model_config("kimi_linear_tiny", c["overrides"])
    hf_config = hf_config_from(cfg)
    gen = torch.Generator().manual_seed(1000 + c["seed"])
    input_ids = torch.randint(0, cfg.vocab_size, (c["batch"], c["seq"]), generator=gen)

    hf_state, ref, info = run_reference(tmp_path, hf_config, c["seed"], input_ids)

    # the reference really ran on transformers' torch path, with the config we asked for
    assert info["fla_modules_loaded"] == [], info["fla_modules_loaded"]
    for op, impl in info["ops"].items():
        assert impl.startswith("transformers.models.kimi_linear.modeling_kimi_linear."), (op, impl)
    for k, v in info["config"].items():
        if k in hf_config:
            assert v == hf_config[k], f"HF config {k}: asked {hf_config[k]!r}, got {v!r}"
    assert info["config"]["num_local_experts"] == cfg.num_experts
    assert info["perturbed_correction_biases"] == cfg.ffn_types().count("moe")
    assert ref.shape == (c["batch"], c["seq"], cfg.vocab_size)

    model = K3ForCausalLM(cfg).eval()
    mapped = map_hf_state_dict(hf_state, cfg)
    model.load_state_dict(mapped, strict=True)  # no missing, no unexpected keys, same shapes
    with torch.no_grad():
        ours = model(input_ids).logits.float()
        err = rel(ours, ref)  # max|ours - ref| / max|ref|

        # negative control: the perturbed norms and the selection-only bias must matter far beyond the tolerance
        for name, t in model.state_dict().items():
            if name.endswith("e_score_correction_bias"):
                t.zero_()
            elif name.endswith(("norm.weight", "o_norm")):
                t.fill_(1.0)
        err_control = rel(model(input_ids).logits.float(), ref)

    print(f"[{case}] relative error vs HF: {err:.3e} (control without norm/bias weights: {err_control:.3e})")
    assert err < RTOL, f"[{case}] max|ours-ref|/max|ref| = {err:.3e} >= {RTOL}"
    assert err_control > 100 * RTOL, f"[{case}] the norm/bias perturbation is invisible: {err_control:.3e}"
