#!/usr/bin/env python
"""Optimizer step time of Per-Head Muon over AdamW, same process, same parameters, same gradients; the last
column is the ratio Muon / AdamW (on CPU only the ratio means anything).

1. k3_tiny: the whole model through build_optimizer (optim=muon vs optim=adamw), random gradients,
   interleaved repetitions, median.
2. The matrices of one full-size K3 layer (conf/model/k3.yaml): KDA or Gated MLA attention plus the Stable
   LatentMoE FFN. Each distinct matrix shape is stepped on its own (one parameter alive at a time, so the
   peak stays near 2 GB) with the layout the model gives it (per-head blocks, per-expert blocks, whole
   matrices) and multiplied by how often the layer holds it. Routed experts are timed on --experts of the
   896 and scaled to 896 (both optimizers are linear in the expert count; all 896 x 3 matrices are 29.6B
   parameters, 118 GB in fp32).
3. --band: NS5's output singular values on full-size K3 shapes for a Gaussian input, from NS5's scalar
   polynomial applied to the input's singular values (exact for the iteration; an SVD of the output
   would cost minutes per shape).

    .venv/bin/python bench/muon.py [--reps 10] [--experts 2] [--skip-full] [--band]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402


def _time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def bench_tiny(reps: int):
    from megatron_k3.config import OptimConfig, load_model_config
    from megatron_k3.model import K3ForCausalLM
    from megatron_k3.optim import build_optimizer

    model = K3ForCausalLM(load_model_config("k3_tiny"))
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    muon = build_optimizer(model, OptimConfig(name="muon"))
    adamw = build_optimizer(model, OptimConfig(name="adamw"))
    muon.step(), adamw.step()  # warm-up, state allocation
    tm, ta = [], []
    for _ in range(reps):  # interleaved, so load from other processes hits both alike
        tm.append(_time(muon.step, 1))
        ta.append(_time(adamw.step, 1))
    n = sum(p.numel() for p in model.parameters())
    m, a = statistics.median(tm), statistics.median(ta)
    print(f"| k3_tiny, whole model ({n / 1e6:.1f}M params) | {m * 1e3:.1f} ms | {a * 1e3:.1f} ms | {m / a:.1f} |")


# One full-size K3 layer: (part, name, shape, how many the layer holds, annotation)
def _k3_layer(cfg):
    D, Hk, K, Hm = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.mla_num_heads
    N, R, V, L, Q = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank
    E, I, Lat, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_width, cfg.num_shared_experts
    heads = lambda n, axis: ("heads", n, axis)  # noqa: E731
    return [
        ("kda", "q/k/v/g_proj", (Hk * K, D), 4, heads(Hk, 0)),
        ("kda", "o_proj", (D, Hk * K), 1, heads(Hk, 1)),
        ("kda", "f_a_proj", (cfg.decay_rank, D), 1, None),
        ("kda", "f_b_proj", (Hk * K, cfg.decay_rank), 1, None),
        ("kda", "b_proj", (Hk, D), 1, None),
        ("mla", "q_a_proj", (Q, D), 1, None),
        ("mla", "q_b_proj", (Hm * (N + R), Q), 1, heads(Hm, 0)),
        ("mla", "kv_a_proj_with_mqa", (L + R, D), 1, None),
        ("mla", "kv_b_proj", (Hm * (N + V), L), 1, heads(Hm, 0)),
        ("mla", "g_proj", (Hm * V, D), 1, heads(Hm, 0)),
        ("mla", "o_proj", (D, Hm * V), 1, heads(Hm, 1)),
        ("moe", "router", (E, D), 1, None),
        ("moe", "latent_down/up", (Lat, D), 2, None),
        ("moe", "shared gate/up/down", (cfg.shared_ffn_size, D), 3, ("experts", S, 0)),
        ("moe", "routed w1/w2/w3", (E, I, Lat), 3, "batched"),
    ]


def ns_flops(shape, annotate, steps: int = 5) -> float:
    """Matmul FLOPs of NS5 on a parameter: per block [a, b] (a <= b) and step, X X^T and B X cost 2 a^2 b
    each and A A costs 2 a^3."""
    if annotate == "batched":
        n, (a, b) = shape[0], shape[1:]
    elif annotate is None:
        n, (a, b) = 1, shape
    else:
        n, axis = annotate[1], annotate[2]
        a, b = (shape[0] // n, shape[1]) if axis == 0 else (shape[0], shape[1] // n)
    a, b = min(a, b), max(a, b)
    return n * steps * (4 * a * a * b + 2 * a ** 3)


def _step_once(shape, annotate, optim: str) -> float:
    """Seconds for one optimizer step of a single parameter of `shape` (after a state-allocating step)."""
    from megatron_k3.annotations import annotate as set_meta
    from megatron_k3.config import OptimConfig
    from megatron_k3.optim import build_optimizer

    p = nn.Parameter(torch.empty(shape).normal_(0, 0.02))
    if annotate == "batched":
        set_meta(p, batched=True)
    elif annotate is not None:
        kind, n, axis = annotate
        set_meta(p, blocks=n, block_axis=axis, block_kind=kind)
    holder = nn.Module()
    holder.p = p
    p.grad = torch.randn(shape) * 1e-3
    opt = build_optimizer(holder, OptimConfig(name=optim, ns_dtype="fp32"))
    t = time.perf_counter()
    opt.step()  # the first step allocates the state (and is timed: Muon's work is the same every step)
    first = time.perf_counter() - t
    if optim == "adamw":  # cheap: take the median of a few more
        return min(first, _time(opt.step, 3))
    return first


def bench_full(experts: int):
    import logging

    from megatron_k3.config import load_model_config

    logging.getLogger("megatron_k3.optim").setLevel(logging.WARNING)
    cfg = load_model_config("k3")
    parts = {}
    print("\n| one K3 layer's matrices (shape timed x multiplicity) | NS5 TFLOP | Muon step | AdamW step | "
          "ratio Muon / AdamW |\n|---|---|---|---|---|")
    for part, name, shape, count, annotate in _k3_layer(cfg):
        scale = count
        if annotate == "batched":  # time a subset of experts, scale to all of them
            scale, shape = count * shape[0] / experts, (experts,) + shape[1:]
        tm, ta = _step_once(shape, annotate, "muon"), _step_once(shape, annotate, "adamw")
        numel, flops = torch.Size(shape).numel() * scale, ns_flops(shape, annotate) * scale
        p = parts.setdefault(part, [0, 0.0, 0.0, 0.0])
        p[0], p[1], p[2], p[3] = p[0] + numel, p[1] + tm * scale, p[2] + ta * scale, p[3] + flops
        print(f"| {part}: {name} {tuple(shape)} x{scale:g} | {flops / 1e12:.2f} | {tm * scale:.2f} s | "
              f"{ta * scale:.3f} s | {tm / ta:.0f} |", flush=True)
    for attn in ("kda", "mla"):
        n, f = parts[attn][0] + parts["moe"][0], parts[attn][3] + parts["moe"][3]
        m, a = parts[attn][1] + parts["moe"][1], parts[attn][2] + parts["moe"][2]
        print(f"| **one K3 layer: {attn.upper()} + MoE ({n / 1e9:.2f}B matrix params)** | {f / 1e12:.0f} | "
              f"{m:.0f} s | {a:.1f} s | **{m / a:.0f}** |")
    for attn in ("kda", "mla", "moe"):
        n, m, a, f = parts[attn]
        print(f"| {attn} matrices only ({n / 1e6:.0f}M params) | {f / 1e12:.1f} | {m:.1f} s | {a:.2f} s | "
              f"{m / a:.0f} |")


def bench_band():
    """Smallest and largest singular value of NS5(G) for Gaussian G of full-size K3 shapes."""
    from megatron_k3.optim.muon import NS_COEFFICIENTS

    a, b, c = NS_COEFFICIENTS
    g = torch.Generator().manual_seed(0)
    shapes = [("KDA head block", (128, 7168)), ("MLA q_b head block", (192, 1536)), ("MLA kv_b head block", (256, 512)),
              ("KDA f_b", (12288, 128)), ("router", (896, 7168)), ("MLA q_a", (1536, 7168)),
              ("latent down/up", (3584, 7168)), ("shared expert block", (3072, 7168)),
              ("routed expert", (3072, 3584)), ("shared MLP whole (not used)", (6144, 7168))]
    print("\n| shape | min s | max s | in [0.6, 1.25] |\n|---|---|---|---|")
    for name, (r, cols) in shapes:
        G = torch.randn(min(r, cols), max(r, cols), generator=g)
        s = torch.linalg.eigvalsh((G @ G.T).double()).clamp_min(0).sqrt() / G.double().norm()
        for _ in range(5):
            s = a * s + b * s ** 3 + c * s ** 5
        ok = 0.6 <= s.min() and s.max() <= 1.25
        print(f"| {name} [{r}, {cols}] | {s.min():.3f} | {s.max():.3f} | {'yes' if ok else 'no'} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--experts", type=int, default=2, help="routed experts actually timed (scaled to 896)")
    ap.add_argument("--skip-full", action="store_true", help="only k3_tiny (the full layer takes minutes)")
    ap.add_argument("--band", action="store_true", help="also NS5's singular values on full-size shapes")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, NS in fp32\n")
    print("| what | Muon step | AdamW step | ratio Muon / AdamW |\n|---|---|---|---|")
    bench_tiny(args.reps)
    if not args.skip_full:
        bench_full(args.experts)
    if args.band:
        bench_band()


if __name__ == "__main__":
    main()
