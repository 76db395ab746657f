"""Training observability: the metrics a short real run writes (MFU and model FLOPs, memory, router entropy
and selection-bias statistics, AttnRes depth weights, per-expert load) and the bound on W&B series at full
size. The PNG plots are tested in tests/test_plots.py."""

import json

import pytest
import torch
from helpers import TINY_MODEL

from megatron_k3.config import load_model_config
from megatron_k3.model import K3ForCausalLM
from megatron_k3.planning.activations import attn_res_sources
from megatron_k3.planning.flops import model_flops
from megatron_k3.training.metrics import ModelStats, attn_res_matrix, throughput, wandb_scalars


@pytest.fixture(scope="module")
def run_dir(short_run_dir):
    return short_run_dir


@pytest.fixture(scope="module")
def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _cfg():
    return load_model_config("k3_tiny", TINY_MODEL)  # the model of conftest.short_run_dir


@pytest.mark.slow
def test_records_hold_flops_mfu_and_memory(rows):
    cfg = _cfg()
    per_token = model_flops(cfg, 64, "causal").train_per_token
    for r in rows:
        assert r["model_flops_per_step"] == pytest.approx(per_token * 4 * 64)  # the planner's own count
        assert r["mfu"] == pytest.approx(r["model_flops_per_step"] / r["step_time_s"] / 0.2e12, rel=1e-6)
        assert r["memory"]["kind"] == "cpu_peak_rss" and r["memory"]["peak_gb"] > 0


@pytest.mark.slow
def test_records_hold_router_and_depth_mix_statistics(rows):
    cfg = _cfg()
    moe = [i for i, t in enumerate(cfg.ffn_types()) if t == "moe"]
    src, out_src = attn_res_sources(cfg)
    for r in rows:
        rp = r["router_per_layer"]
        assert rp["layers"] == moe
        assert all(0 < e <= 1 for e in rp["entropy"])
        for k in ("bias_mean", "bias_std", "bias_min", "bias_max", "bias_drift"):
            assert len(rp[k]) == len(moe)
        assert 0 < r["router"]["entropy_min"] <= r["router"]["entropy_mean"] <= 1
        ar = r["attn_res_weights"]
        assert ar["layers"] == list(range(cfg.num_layers))
        for i, (pre, post) in enumerate(src):  # the decoder's bookkeeping = the planner's
            assert (len(ar["pre_mixer"][i]) if ar["pre_mixer"][i] else 0) == pre
            assert len(ar["pre_ffn"][i]) == post
        assert len(ar["output"]) == out_src
        for w in [w for w in ar["pre_mixer"] + ar["pre_ffn"] if w] + [ar["output"]]:
            assert sum(w) == pytest.approx(1.0, abs=1e-5)  # softmax over depth
    m, labels = attn_res_matrix(rows[-1]["attn_res_weights"])
    assert m.shape == (len(labels), out_src) and labels[-1] == "output"


@pytest.mark.slow
def test_per_expert_load_on_the_media_cadence(rows):
    cfg = _cfg()
    detail = {r["step"]: r["expert_load_per_expert"] for r in rows if "expert_load_per_expert" in r}
    assert sorted(detail) == [1, 2]  # step 1 and every media_interval (2) steps
    for d in detail.values():
        assert len(d["tokens"]) == len(d["layers"]) and all(len(t) == cfg.num_experts for t in d["tokens"])
        assert all(sum(t) == 4 * 64 * cfg.top_k for t in d["tokens"])  # every token-expert pair of the step


def test_wandb_series_stay_bounded_at_full_size():
    """A full-size record (92 MoE layers x 896 experts, 93 layers of depth mixes over up to 9 sources) gives
    a few scalar series per MoE layer and a fixed number otherwise: per-expert and per-mix detail goes to
    images and tables, never to thousands of series."""
    cfg = load_model_config("k3")
    moe = [i for i, t in enumerate(cfg.ffn_types()) if t == "moe"]
    src, out_src = attn_res_sources(cfg)
    L = len(moe)
    rec = {"step": 5, "loss": 2.0, "lr": 1e-4, "grad_norm": 1.0, "tokens": 1, "tokens_per_s": 1.0, "mfu": 0.4,
           "model_tflops_per_s_per_device": 300.0, "model_flops_per_step": 1e19, "step_time_s": 1.0,
           "memory": {"kind": "cuda_max_allocated", "peak_gb": 120.0},
           "expert_load": {"max_over_mean": 1.1, "cv": 0.05, "dropped_frac": 0.0},
           "expert_load_per_layer": {"max_over_mean": [1.1] * L, "min_over_mean": [0.9] * L, "cv": [0.05] * L,
                                     "layers": moe},
           "router": {"entropy_mean": 0.9, "entropy_min": 0.8, "bias_absmax": 0.1, "bias_std": 0.01,
                      "bias_drift": 0.001},
           "router_per_layer": {"layers": moe, "entropy": [0.9] * L, "bias_mean": [0.0] * L, "bias_std": [0.01] * L,
                                "bias_min": [-0.1] * L, "bias_max": [0.1] * L, "bias_drift": [0.001] * L},
           "attn_res_weights": {"layers": list(range(93)), "pre_mixer": [[1 / p] * p if p else None for p, _ in src],
                                "pre_ffn": [[1 / q] * q for _, q in src], "output": [1 / out_src] * out_src},
           "attn_res": {"embedding_weight": 0.2, "partial_weight": 0.3}}
    loads = torch.rand(L, 896) * 100
    flat = wandb_scalars(rec, loads, moe, top_experts=4)
    assert len(flat) <= 2 * L + 64, len(flat)  # 2 per MoE layer + a fixed set (here ~50)
    assert sum(k.startswith("attn_res_output/") for k in flat) == out_src == 9
    assert sum(k.startswith("expert_load_layer/") for k in flat) == 2 * L


def test_model_stats_bias_drift_and_entropy():
    torch.manual_seed(0)
    cfg = load_model_config("k3_tiny")
    model = K3ForCausalLM(cfg)
    stats = ModelStats(model)
    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    with torch.no_grad():
        model(ids)
    stats.accumulate()
    first = stats.collect()
    assert first["router"]["bias_drift"] == 0.0 and first["router"]["bias_absmax"] == 0.0
    with torch.no_grad():
        for k, r in enumerate(stats.routers):
            r.e_score_correction_bias.copy_(torch.linspace(-1, 1, cfg.num_experts) * (k + 1) * 0.01)
        model(ids)
    stats.accumulate()
    s = stats.collect()["router_per_layer"]
    for k in range(len(stats.routers)):
        b = torch.linspace(-1, 1, cfg.num_experts) * (k + 1) * 0.01
        assert s["bias_min"][k] == pytest.approx(-0.01 * (k + 1), abs=1e-6)
        assert s["bias_max"][k] == pytest.approx(0.01 * (k + 1), abs=1e-6)
        assert s["bias_std"][k] == pytest.approx(float(b.std(unbiased=False)), abs=1e-6)
        assert s["bias_drift"][k] == pytest.approx(float(b.pow(2).mean().sqrt()), abs=1e-6)  # RMS change
        assert 0 < s["entropy"][k] <= 1


def test_throughput_arithmetic():
    t = throughput(6e9, tokens=1000, seconds=2.0, peak_tflops=1.0, world=4)
    assert t["model_flops_per_step"] == 6e12
    assert t["model_tflops_per_s_per_device"] == pytest.approx(0.75)
    assert t["mfu"] == pytest.approx(0.75)
