#!/usr/bin/env python
"""Benchmark: forward+backward tokens/s of our MoE layer (StableLatentMoE) against Hugging Face's Kimi Linear
MoE block (its default per-expert loop and its `grouped_mm` experts) and DeepSpeed's `deepspeed.moe.layer.MoE`,
equal sizes, same inputs and weights, one process, CPU.

    nice -n 5 .venv/bin/python bench/moe.py [--batch 1 --seq 2048 --hidden 256 --experts 32 --top-k 4 --inter 128]
                                            [--reps 20 --warmup 3 --threads 2] [--latent 128] [--no-profile]

Loss = out.square().mean(), backward to the input and every weight; the implementations run round-robin in each
repetition (so load from other jobs hits them alike) and the table reports medians. Before timing it checks that
ours and HF's compute the same function on the same weights, and that DeepSpeed picks the same experts. It also
times the bare expert GEMMs the layer must do (the ceiling for any implementation) and profiles ours.

transformers binds Kimi Linear's ops to fla's Triton kernels when fla is importable; this process blocks `fla`
before importing transformers, as bench/train_step.py does (the MoE block does not use fla either way).
On a machine loaded by other jobs, 2-thread OpenMP regions stall on a descheduled sibling and the medians swing by
several x; the load average and a 2048^3 matmul's GFLOP/s are printed so such runs can be recognised.
"""

from __future__ import annotations

import argparse
import importlib.abc
import logging
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from machine import machine  # noqa: E402  (bench/machine.py)


class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in ("fla", "causal_conv1d"):
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked by bench/moe.py)")
        return None


sys.meta_path.insert(0, _Block())

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from megatron_k3.config import load_model_config  # noqa: E402
from megatron_k3.model.dispatcher import Dispatcher, capacity  # noqa: E402
from megatron_k3.model.moe import StableLatentMoE  # noqa: E402

GEMM_OPS = ("aten::_grouped_mm", "aten::bmm", "aten::mm", "aten::addmm", "aten::matmul", "aten::linear")


# ---------------------------------------------------------------- shared weights (one draw, copied into every impl)

def make_weights(D, E, I, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, std: torch.randn(*s, generator=g) * std  # noqa: E731
    return dict(
        router=r(E, D, std=D ** -0.5),  # logits ~ N(0, 1) for x ~ N(0, 1): a realistic, uneven expert load
        w1=r(E, I, D, std=D ** -0.5), w3=r(E, I, D, std=D ** -0.5), w2=r(E, D, I, std=I ** -0.5),
        s_gate=r(I, D, std=D ** -0.5), s_up=r(I, D, std=D ** -0.5), s_down=r(D, I, std=I ** -0.5),
    )


def build_ours(args, W, act, overflow, latent=0):
    over = [f"hidden_size={args.hidden}", f"num_experts={args.experts}", f"top_k={args.top_k}",
            f"moe_intermediate_size={args.inter}", f"moe_latent_size={latent}",
            f"moe_latent_norm={'true' if latent else 'false'}", "num_shared_experts=1",
            "shared_intermediate_size=0", f"hidden_act={act}", f"moe_overflow={overflow}",
            f"moe_capacity_factor={args.capacity_factor}", "router_force_balanced=false",
            # HF's Kimi Linear router: sigmoid scores, top-k renormalised (norm_topk_prob), scale 1 here
            "norm_topk_prob=true", "routed_scaling_factor=1.0", "router_num_groups=1", "router_topk_groups=1"]
    cfg = load_model_config("kimi_linear_tiny", over)
    m = StableLatentMoE(cfg).train()
    with torch.no_grad():
        m.gate.weight.copy_(W["router"])
        m.gate.e_score_correction_bias.zero_()
        if latent:  # the latent variant's experts run at width L: its own (seeded) weights, not comparable
            g = torch.Generator().manual_seed(1)
            for p in (m.latent_down_proj.weight, m.latent_up_proj.weight, m.experts.w1, m.experts.w3, m.experts.w2):
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        else:
            m.experts.w1.copy_(W["w1"])
            m.experts.w3.copy_(W["w3"])
            m.experts.w2.copy_(W["w2"])
        m.shared_experts.gate_proj.weight.copy_(W["s_gate"])
        m.shared_experts.up_proj.weight.copy_(W["s_up"])
        m.shared_experts.down_proj.weight.copy_(W["s_down"])
    return m


def build_hf(args, W, impl):
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE

    cfg = KimiLinearConfig(hidden_size=args.hidden, moe_intermediate_size=args.inter, num_local_experts=args.experts,
                           num_experts_per_tok=args.top_k, n_shared_experts=1, n_group=1, topk_group=1,
                           norm_topk_prob=True, routed_scaling_factor=1.0, hidden_act="silu")
    cfg._experts_implementation = impl  # "eager" (per-expert loop) or "grouped_mm"
    m = KimiLinearMoE(cfg).float().train()
    with torch.no_grad():
        m.gate.weight.copy_(W["router"])
        m.gate.e_score_correction_bias.zero_()
        m.experts.gate_up_proj.copy_(torch.cat([W["w1"], W["w3"]], 1))  # [E, 2I, D]: gate rows, then up rows
        m.experts.down_proj.copy_(W["w2"])
        m.shared_experts.gate_proj.weight.copy_(W["s_gate"])
        m.shared_experts.up_proj.weight.copy_(W["s_up"])
        m.shared_experts.down_proj.weight.copy_(W["s_down"])
    assert m.experts.config._experts_implementation == impl
    return m


class SwiGLU(nn.Module):
    def __init__(self, D, I):
        super().__init__()
        self.gate_proj = nn.Linear(D, I, bias=False)
        self.up_proj = nn.Linear(D, I, bias=False)
        self.down_proj = nn.Linear(I, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepSpeedMoEWithShared(nn.Module):
    """deepspeed.moe.layer.MoE (ep_size=1, k=top_k, drop_tokens=False) plus the same shared SwiGLU expert as the
    others, added to its output as HF's block does (DeepSpeed's MoE has no shared expert of its own)."""

    def __init__(self, args, W):
        super().__init__()
        from deepspeed.moe.layer import MoE

        D, I = args.hidden, args.inter
        self.moe = MoE(D, SwiGLU(D, I), num_experts=args.experts, ep_size=1, k=args.top_k, drop_tokens=False,
                       use_rts=False)
        self.moe.set_deepspeed_parallelism()
        self.shared = SwiGLU(D, I)
        with torch.no_grad():
            self.moe.deepspeed_moe.gate.wg.weight.copy_(W["router"])
            for e, ex in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                ex.gate_proj.weight.copy_(W["w1"][e])
                ex.up_proj.weight.copy_(W["w3"][e])
                ex.down_proj.weight.copy_(W["w2"][e])
            self.shared.gate_proj.weight.copy_(W["s_gate"])
            self.shared.up_proj.weight.copy_(W["s_up"])
            self.shared.down_proj.weight.copy_(W["s_down"])

    def forward(self, x):
        return self.moe(x)[0] + self.shared(x)


def init_deepspeed():
    import deepspeed
    import torch.distributed as dist

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo needs no JIT-compiled shm collective
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    os.environ.setdefault("LOCAL_RANK", "0")
    if not dist.is_initialized():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, dist_init_required=False)  # wrap the group


# ---------------------------------------------------------------- timing

def fwd_bwd(module, x):
    """One forward+backward (loss = out.square().mean(), gradients to x and every weight); returns seconds."""
    for p in module.parameters():
        p.grad = None
    xl = x.detach().clone().requires_grad_()
    t0 = time.perf_counter()
    out = module(xl)
    out.square().mean().backward()
    return time.perf_counter() - t0


def gemm_kernels(N, k, E, D, I, cap):
    """Callables that run only GEMMs the layer must do, with no autograd, dispatch or elementwise work:
    the routed experts' 3 forward GEMMs (gate, up, down) and 6 backward ones (input and weight gradient of
    each) for N*k rows split evenly over E experts, as bmm on [E, N*k/E, .] and as torch._grouped_mm on
    [N*k, .] rows; the same bmm on E*cap rows (what the drop path computes, padding included); the 7 GEMMs
    of the fused gate/up form ours runs, as _grouped_mm on N*k rows and as bmm on E*cap rows; and the shared
    expert's 9 plus the router's 3 GEMMs."""
    g = torch.Generator().manual_seed(3)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    W1, W3, W2 = rn(E, I, D), rn(E, I, D), rn(E, D, I)

    def routed_bmm(C):
        X, H, dG, dU, dY = rn(E, C, D), rn(E, C, I), rn(E, C, I), rn(E, C, I), rn(E, C, D)

        def run():
            torch.bmm(X, W1.transpose(1, 2)), torch.bmm(X, W3.transpose(1, 2)), torch.bmm(H, W2.transpose(1, 2))
            torch.bmm(dY, W2), torch.bmm(dY.transpose(1, 2), H)  # dH, dW2
            torch.bmm(dG, W1), torch.bmm(dG.transpose(1, 2), X)  # dX (gate part), dW1
            torch.bmm(dU, W3), torch.bmm(dU.transpose(1, 2), X)  # dX (up part), dW3
        return run

    C = N * k // E
    offs = torch.arange(1, E + 1, dtype=torch.int32) * C
    x2, h2, dg2, du2, dy2 = rn(E * C, D), rn(E * C, I), rn(E * C, I), rn(E * C, I), rn(E * C, D)
    gm = torch._grouped_mm

    # as ours runs them (megatron_k3.model.experts): w1/w3 as one [E, 2I, D] weight, so forward gate+up and the
    # backward input gradient are one GEMM each; 7 GEMMs instead of 9, the same FLOPs
    W13 = torch.cat([W1, W3], 1)

    def fused_bmm(C):
        X, H, dGU, dY = rn(E, C, D), rn(E, C, I), rn(E, C, 2 * I), rn(E, C, D)

        def run():
            torch.bmm(X, W13.transpose(1, 2)), torch.bmm(H, W2.transpose(1, 2))
            torch.bmm(dY, W2), torch.bmm(dY.transpose(1, 2), H)  # dH, dW2
            torch.bmm(dGU, W13)  # dX
            torch.bmm(dGU[..., :I].transpose(1, 2), X), torch.bmm(dGU[..., I:].transpose(1, 2), X)  # dW1, dW3
        return run

    def routed_grouped():
        gm(x2, W1.transpose(1, 2), offs=offs), gm(x2, W3.transpose(1, 2), offs=offs)
        gm(h2, W2.transpose(1, 2), offs=offs)
        gm(dy2, W2, offs=offs), gm(dy2.t(), h2, offs=offs)  # dH [M, I], dW2 [E, D, I]
        gm(dg2, W1, offs=offs), gm(dg2.t(), x2, offs=offs)
        gm(du2, W3, offs=offs), gm(du2.t(), x2, offs=offs)

    dgu2 = rn(E * C, 2 * I)

    def fused_grouped():
        gm(x2, W13.transpose(1, 2), offs=offs), gm(h2, W2.transpose(1, 2), offs=offs)
        gm(dy2, W2, offs=offs), gm(dy2.t(), h2, offs=offs)
        gm(dgu2, W13, offs=offs)
        gm(dgu2[:, :I].t(), x2, offs=offs), gm(dgu2[:, I:].t(), x2, offs=offs)

    xs, s1, s3, s2, hs, dgs, dus, dys = rn(N, D), rn(I, D), rn(I, D), rn(D, I), rn(N, I), rn(N, I), rn(N, I), rn(N, D)
    wr, dr = rn(E, D), rn(N, E)

    def shared_router():
        xs @ s1.t(), xs @ s3.t(), hs @ s2.t()
        dys @ s2, dys.t() @ hs, dgs @ s1, dgs.t() @ xs, dus @ s3, dus.t() @ xs
        xs @ wr.t(), dr @ wr, dr.t() @ xs

    a, b = rn(2048, 2048), rn(2048, 2048)
    routed = 3 * 2 * N * k * 3 * D * I  # fwd+bwd = 3x forward; forward = 3 GEMMs of 2*D*I FLOPs per row
    return {  # name: (callable, FLOPs)
        "GEMMs only: routed, bmm": (routed_bmm(C), routed),
        "GEMMs only: routed, _grouped_mm": (routed_grouped, routed),
        f"GEMMs only: routed, bmm on {E}x{cap} capacity rows": (routed_bmm(cap), routed * E * cap // (N * k)),
        "GEMMs only: routed, fused gate/up, _grouped_mm (as ours dropless)": (fused_grouped, routed),
        f"GEMMs only: routed, fused gate/up, bmm on {E}x{cap} capacity rows (as ours drop)":
            (fused_bmm(cap), routed * E * cap // (N * k)),
        "GEMMs only: shared expert + router": (shared_router, 3 * 2 * N * (3 * D * I + D * E)),
        "GEMMs only: one 2048^3 matmul (throughput reference)": (lambda: a @ b, 2 * 2048 ** 3)}


def out_and_grad(m, x):
    """(output, input gradient) of one forward+backward of `m` on a copy of x (loss out.square().mean()); the
    weights' gradients are cleared afterwards."""
    xl = x.clone().requires_grad_()
    y = m(xl)
    y.square().mean().backward()
    for p in m.parameters():
        p.grad = None
    return y.detach(), xl.grad


def _timed(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def round_robin(runs, warmup, reps):
    """{name: [seconds per repetition]} of the callables `runs` (each returns its own seconds), after `warmup`
    untimed rounds; every repetition runs each once in turn, so load from other jobs hits them alike."""
    for _ in range(warmup):
        for run in runs.values():
            run()
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            times[name].append(run())
    return times


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def parser():
    """The command line (also read by bench/compile.py for the default shapes: `parser().parse_args([])`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--inter", type=int, default=128, help="expert (and shared expert) intermediate width")
    ap.add_argument("--capacity-factor", type=float, default=1.25, help="for our drop (static-shape) mode")
    ap.add_argument("--latent", type=int, default=128, help="latent width of the Stable LatentMoE row (0: skip it)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--profile-top", type=int, default=10, help="ops listed per profile")
    ap.add_argument("--no-deepspeed", action="store_true")
    return ap


def main():
    args = parser().parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, T, D, E, k, I = args.batch, args.seq, args.hidden, args.experts, args.top_k, args.inter
    N = B * T

    W = make_weights(D, E, I)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(7))

    ours = {
        "ours dropless (grouped_mm), silu": build_ours(args, W, "silu", "dropless"),
        f"ours drop cf={args.capacity_factor} (bmm), silu": build_ours(args, W, "silu", "drop"),
        "ours dropless, situ": build_ours(args, W, "situ", "dropless"),
        f"ours drop cf={args.capacity_factor}, situ": build_ours(args, W, "situ", "drop"),
    }
    hf_eager, hf_grouped = build_hf(args, W, "eager"), build_hf(args, W, "grouped_mm")
    peers = {"HF KimiLinearMoE, eager loop": hf_eager, "HF KimiLinearMoE, grouped_mm": hf_grouped}
    if not args.no_deepspeed:
        init_deepspeed()
        ds = DeepSpeedMoEWithShared(args, W).train()
        peers["DeepSpeed MoE (+ shared SwiGLU)"] = ds
    extra = {}
    if args.latent:
        extra[f"ours Stable LatentMoE L={args.latent}, situ, dropless"] = build_ours(args, W, "situ", "dropless",
                                                                                     args.latent)

    print(f"machine: {machine()}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")
    print(f"shape: {N} tokens (B={B}, T={T}), hidden {D}, {E} experts, top-{k}, expert width {I}, one shared "
          f"expert of width {I}; fp32; torch.set_num_threads({args.threads}); forward+backward, "
          f"loss = out.square().mean(), gradients to the input and all weights")

    # ---- equality: same weights, same input -> same output and input gradient (ours silu dropless vs HF)
    ours_main = "ours dropless (grouped_mm), silu"
    ref = ours[ours_main]

    y_ref, g_ref = out_and_grad(ref, x)
    counts = ref.tokens_per_expert_E
    print(f"expert load (assignments per expert, mean {N * k / E:.0f}): min {counts.min():.0f}, max {counts.max():.0f}")
    for name, m in (("HF KimiLinearMoE, eager loop", hf_eager), ("HF KimiLinearMoE, grouped_mm", hf_grouped)):
        y, gx = out_and_grad(m, x)
        print(f"check: {name} vs ours dropless silu: max rel diff output {rel(y, y_ref):.1e}, "
              f"input grad {rel(gx, g_ref):.1e}")
        assert rel(y, y_ref) < 1e-5 and rel(gx, g_ref) < 1e-5, name  # fp32: ~1e-5 relative
    drop = ours[f"ours drop cf={args.capacity_factor} (bmm), silu"]
    y_d, _ = out_and_grad(drop, x)
    C = capacity(N, k, E, args.capacity_factor)
    print(f"check: ours drop cf={args.capacity_factor} (capacity {C} slots/expert = {E * C} rows computed for "
          f"{N * k} assignments) dropped {drop.dropped_assignments.item():.0f} assignments; max rel diff output vs "
          f"dropless {rel(y_d, y_ref):.1e}")
    if not args.no_deepspeed:
        # DeepSpeed routes by softmax(x W^T) top-k, renormalised: the same experts as the sigmoid router (both
        # monotone in the logits), other combine weights. Check its output against our dispatch with its weights.
        with torch.no_grad():
            y_ds = ds(x).reshape(N, D)
            logits = x.reshape(N, D) @ W["router"].t()
            top_p, idx = logits.softmax(-1).topk(k, dim=-1)
            w_ds = top_p / top_p.sum(-1, keepdim=True)
            r, _ = Dispatcher("dropless", 1.0)(x.reshape(N, D), idx, w_ds, ref.experts)
            y_chk = r + ref.shared_experts(x.reshape(N, D))
            same_experts = torch.equal(ds.moe.deepspeed_moe.exp_counts.float(), counts.float())
        print(f"check: DeepSpeed picks the same experts (per-expert counts equal: {same_experts}); its output vs our "
              f"experts with its softmax combine weights: max rel diff {rel(y_ds, y_chk):.1e}")
        assert same_experts and rel(y_ds, y_chk) < 1e-5
    print("checks passed: ours (silu, dropless) and HF's block compute the same function on the same weights "
          "(router: sigmoid, top-k renormalised, scale 1, zero correction bias)")

    # ---- timing: round-robin over implementations, median of reps
    impls = {**ours, **peers, **extra}
    kernels = gemm_kernels(N, k, E, D, I, C)
    runs = {**{n: (lambda m=m: fwd_bwd(m, x)) for n, m in impls.items()}, **{n: (lambda f=f: _timed(f)) for n, (f, _)
                                                                                 in kernels.items()}}
    load0 = os.getloadavg()[0]
    times = round_robin(runs, args.warmup, args.reps)
    load1 = os.getloadavg()[0]
    med = {name: statistics.median(ts) for name, ts in times.items()}

    print(f"load average (1 min) before/after timing: {load0:.2f} / {load1:.2f}")
    print()
    names = list(peers)
    short = {n: n.replace("HF KimiLinearMoE, ", "HF ").replace(" (+ shared SwiGLU)", "") for n in names}
    print("| implementation | reps | median ms | best ms | tokens/s (median) | "
          + " | ".join(f"ratio vs {short[n]}" for n in names) + " |")
    print("|" + "---|" * (5 + len(names)))
    for name in impls:
        m_ = med[name]
        print(f"| {name} | {len(times[name])} | {m_ * 1e3:.1f} | {min(times[name]) * 1e3:.1f} | {N / m_:,.0f} | "
              + " | ".join(f"{med[p] / m_:.2f}" for p in names) + " |")
    print("(ratio = tokens/s of the row / tokens/s of the column's peer, both medians over the same round-robin "
          "repetitions; > 1: the row is faster)")

    print()
    print("GEMMs alone, timed in the same round-robin (plain calls, no autograd; routed = 3 GEMMs forward + 6 "
          f"backward over {N * k} rows split evenly over {E} experts):")
    print("| GEMMs only | GFLOP | median ms | best ms | GFLOP/s (median) | tokens/s if the layer were only this |")
    print("|---|---|---|---|---|---|")
    for name, (_, fl) in kernels.items():
        tok = f"{N / med[name]:,.0f}" if "2048^3" not in name else "-"
        print(f"| {name.split(': ', 1)[1]} | {fl / 1e9:.2f} | {med[name] * 1e3:.1f} | {min(times[name]) * 1e3:.1f} | "
              f"{fl / med[name] / 1e9:.0f} | {tok} |")
    (kb, flops), (kg, _), (kc, _), (kfg, _), (kfc, _), (ks, _), (kp, fp) = ((med[n], fl) for n, (_, fl) in
                                                                          kernels.items())
    bound, peak = min(kb, kg, kfg), fp / kp
    print(f"routed-expert GEMM bound at these shapes: {bound * 1e3:.1f} ms ({N / bound:,.0f} tokens/s); all GEMMs of "
          f"the layer (+ shared expert and router): {(bound + ks) * 1e3:.1f} ms ({N / (bound + ks):,.0f} tokens/s); "
          f"the routed GEMMs at the 2048^3 matmul's {peak / 1e9:.0f} GFLOP/s would take {flops / peak * 1e3:.1f} ms "
          f"({N / (flops / peak):,.0f} tokens/s)")
    for name, own in ((ours_main, kfg), (f"ours drop cf={args.capacity_factor} (bmm), silu", kfc)):
        print(f"{name}: {med[name] * 1e3:.1f} ms = {med[name] / bound:.1f}x the routed-GEMM bound "
              f"({bound / med[name]:.0%} of its speed), {med[name] / (bound + ks):.1f}x all GEMMs, "
              f"{med[name] / (flops / peak):.1f}x the routed GEMMs at large-matmul throughput; its own GEMMs as it "
              f"runs them (+ shared + router, even split) are {(own + ks) / med[name]:.0%} of its time")

    if args.no_profile:
        return
    from torch.profiler import ProfilerActivity, profile

    for name in (ours_main, f"ours drop cf={args.capacity_factor} (bmm), silu", "HF KimiLinearMoE, grouped_mm"):
        m = impls[name]
        steps = 5
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                fwd_bwd(m, x)
        ev = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in ev)
        gemm = sum(e.self_cpu_time_total for e in ev if e.key in GEMM_OPS)
        print()
        print(f"profile of '{name}' ({steps} fwd+bwd, self CPU time; total {total / steps / 1e3:.1f} ms/step, "
              f"GEMM ops {gemm / total:.0%}):")
        print("| op | self CPU ms / step | share | calls / step |")
        print("|---|---|---|---|")
        for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:args.profile_top]:
            print(f"| {e.key} | {e.self_cpu_time_total / steps / 1e3:.2f} | "
                  f"{e.self_cpu_time_total / total:.0%} | {e.count / steps:.0f} |")


if __name__ == "__main__":
    main()
