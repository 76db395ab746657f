"""Parity with Hugging Face Kimi Linear: our model configured as Kimi Linear, loaded with the weights of a randomly
initialised `transformers` `KimiLinearForCausalLM`, gives the same logits (fp32, 1e-4 relative).

The reference runs in a subprocess (tests/hf_reference.py) in which `fla` cannot be imported, so transformers
uses its own PyTorch ops on the CPU instead of fla's Triton kernels. The HF -> ours weight mapping is
megatron_k3.interop.kimi_linear.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import max_abs_rel, run_hf_reference

from megatron_k3.config import load_model_config
from megatron_k3.interop.kimi_linear import hf_config_from, map_hf_state_dict
from megatron_k3.model import K3ForCausalLM

pytestmark = pytest.mark.slow  # multi-process worlds or training runs

if importlib.util.find_spec("transformers.models.kimi_linear") is None:  # pragma: no cover
    pytest.skip("transformers lacks transformers.models.kimi_linear", allow_module_level=True)

RTOL = 1e-4


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
def test_logits_match_hf_kimi_linear(case, tmp_path):
    c = CASES[case]
    cfg = load_model_config("kimi_linear_tiny", c["overrides"])
    hf_config = hf_config_from(cfg)
    gen = torch.Generator().manual_seed(1000 + c["seed"])
    input_ids = torch.randint(0, cfg.vocab_size, (c["batch"], c["seq"]), generator=gen)

    hf_state, ref, info = run_hf_reference(tmp_path, hf_config, c["seed"], input_ids)

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
        err = max_abs_rel(ours, ref)  # max|ours - ref| / max|ref|

        # negative control: the perturbed norms and the selection-only bias must matter far beyond the tolerance
        for name, t in model.state_dict().items():
            if name.endswith("e_score_correction_bias"):
                t.zero_()
            elif name.endswith(("norm.weight", "o_norm")):
                t.fill_(1.0)
        err_control = max_abs_rel(model(input_ids).logits.float(), ref)

    print(f"[{case}] relative error vs HF: {err:.3e} (control without norm/bias weights: {err_control:.3e})")
    assert err < RTOL, f"[{case}] max|ours-ref|/max|ref| = {err:.3e} >= {RTOL}"
    assert err_control > 100 * RTOL, f"[{case}] the norm/bias perturbation is invisible: {err_control:.3e}"
