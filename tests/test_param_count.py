"""tools/param_count.py: K3 at full size is 2.78T total / 104.2B active (with its vision tower and projector,
0.447B more of both); meta counts equal real ones."""

import json
import subprocess
import sys
from pathlib import Path

from megatron_k3.config import load_model_config
from megatron_k3.model import K3ForCausalLM, K3ForConditionalGeneration
from megatron_k3.model.params import count_parameters
from megatron_k3.planning.params import count_parameters as count_with_vision

ROOT = Path(__file__).resolve().parent.parent


def test_k3_full_size_counts():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "param_count.py"), "model=k3"],
                         capture_output=True, text=True, timeout=120, check=True)
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert abs(d["total"] / 2.78e12 - 1) < 0.01, d["total"]
    assert abs(d["active"] / 104.2e9 - 1) < 0.01, d["active"]


def test_kimi_linear_48b_counts():
    d = count_parameters(load_model_config("kimi_linear_48b"))
    assert abs(d["total"] / 48e9 - 1) < 0.05 and abs(d["active"] / 3e9 - 1) < 0.1


def test_meta_count_equals_instantiated_model():
    cfg = load_model_config("k3_tiny")
    d = count_parameters(cfg)
    model = K3ForCausalLM(cfg)
    assert d["total"] == sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    emb = model.model.embed_tokens.weight.numel()
    assert d["active"] == d["total"] - routed + routed * cfg.top_k // cfg.num_experts - emb


def test_bad_override_exits_nonzero():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "param_count.py"), "model=k3", "model.top_k=0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "model.top_k" in out.stderr


def test_vision_tower_count_equals_the_built_model():
    """k3_vl_tiny: the tower and projector are breakdown entries of their own, in total and active; the total is the
    built K3ForConditionalGeneration's; the text part is unchanged."""
    cfg = load_model_config("k3_vl_tiny")
    d = count_with_vision(cfg)
    model = K3ForConditionalGeneration(cfg)
    assert d["total"] == sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for p in model.vision_tower.parameters())
    proj = sum(p.numel() for p in model.mm_projector.parameters())
    assert (d["breakdown"]["vision_tower"], d["breakdown"]["mm_projector"]) == (tower, proj) == (107584, 98432)
    text = count_parameters(cfg)
    assert d["total"] - text["total"] == d["active"] - text["active"] == tower + proj
    assert count_with_vision(load_model_config("k3_vl_tiny", ["model.vision.enabled=false"])) == text


def test_k3_vision_tower_counts():
    """The released tower (27 blocks, width 1024, q/k/v 1536, MLP 4096, 64 x 64 position table, 14 x 14 patches):
    patch embedding 1024 x 588 + table 64 x 64 x 1024 + 27 x (4608 x 1024 + 1024 x 1536 + 2 x 4096 x 1024 + 2 x
    1024) + final norm; projector 4096^2 + 7168 x 4096 + 7168."""
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "param_count.py"), "model=k3",
                          "model.vision.enabled=true"], capture_output=True, text=True, timeout=120, check=True)
    d = json.loads(out.stdout.strip().splitlines()[-1])
    tower = 1024 * 588 + 64 * 64 * 1024 + 27 * (4608 * 1024 + 1024 * 1536 + 2 * 4096 * 1024 + 2 * 1024) + 1024
    proj = 4096 * 4096 + 7168 * 4096 + 7168
    assert (d["breakdown"]["vision_tower"], d["breakdown"]["mm_projector"]) == (tower, proj) == (401214464, 46144512)
    assert d["total"] == 2779484393568 + tower + proj and d["active"] == 104189530208 + tower + proj
