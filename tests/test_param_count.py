"""tools/param_count.py: K3 at full size is 2.78T total / 104.2B active; meta counts equal real ones."""

import json
import subprocess
import sys
from pathlib import Path

from megatron_k3.config import load_model_config
from megatron_k3.model import K3ForCausalLM
from megatron_k3.model.params import count_parameters

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
