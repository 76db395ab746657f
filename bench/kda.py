"""Benchmark: KDA forward+backward, our torch chunk_kda against fla's naive_chunk_kda and naive_recurrent_kda (CPU).

Usage: python bench/kda.py [--T 4096] [--H 4] [--K 128] [--reps 5] [--peer-reps 1] [--skip-recurrent]
Prints a table whose last column is the ratio (peer time / ours), plus FLOPs and matmul-throughput fraction.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from machine import machine  # noqa: E402  (bench/machine.py)

from megatron_k3.ops.kda import chunk_kda  # noqa: E402


def load_fla_naive():
    """fla/ops/kda/naive.py loaded by path (importing the fla package pulls in Triton and takes seconds)."""
    spec = importlib.util.find_spec("fla")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    mod_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def make_inputs(T, H, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(
        q=F.normalize(randn(1, T, H, K), dim=-1),
        k=F.normalize(randn(1, T, H, K), dim=-1),
        v=randn(1, T, H, V),
        g=F.logsigmoid(randn(1, T, H, K) + 3.0),  # moderate decay, so naive_chunk_kda's exp(G) stays in range
        beta=torch.sigmoid(randn(1, T, H)),
    )


def fwd_bwd(fn, inputs):
    """One forward+backward with sum(o) as the loss; returns (seconds, o)."""
    leaves = {name: x.clone().requires_grad_() for name, x in inputs.items()}
    t0 = time.perf_counter()
    o, _ = fn(**leaves)
    o.sum().backward()
    return time.perf_counter() - t0, o.detach()


def kda_chunk_flops(T, H, K, V, C):
    """Forward+backward FLOPs of the chunked algorithm.

    Counting rule: matmul-class work only, 2 FLOPs per multiply-add: the lower triangles of A_qk and A_kk
    (2 C^2 K together), the unit-triangular solve (C^2 (K+V)), A_qk [U|W] (2 C^2 (K+V)), K_tail^T [U|W]
    (2 C K (K+V)), the chunk hand-off M S (2 K^2 V) and O = P S (2 C K V), per chunk and head. Elementwise
    work (exp, masks, the 0/1 span matmuls that play cumulative sums) is not counted. Backward = 2x forward
    (each product has two input gradients of its own size), so the total is 3x forward.
    """
    per_chunk = 2 * C * C * K + C * C * (K + V) + 2 * C * C * (K + V) + 2 * C * K * (K + V) + 2 * K * K * V \
        + 2 * C * K * V
    return 3 * per_chunk * (-(-T // C)) * H


def matmul_gflops(n=2048, reps=3):
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)
    best = min(_timed(lambda: torch.matmul(a, b)) for _ in range(reps))
    return 2 * n**3 / best / 1e9


def _timed(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--K", type=int, default=128, help="key = value head dim")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions of ours (after one warm-up)")
    ap.add_argument("--peer-reps", type=int, default=1, help="repetitions of each naive peer (slow)")
    ap.add_argument("--skip-recurrent", action="store_true", help="do not run naive_recurrent_kda")
    args = ap.parse_args()
    T, H, K, C = args.T, args.H, args.K, args.chunk_size
    V = K
    inputs = make_inputs(T, H, K, V)
    naive = load_fla_naive()

    print(f"machine: {machine()}")
    print(f"shape: B=1 T={T} H={H} K=V={K} chunk={C} fp32, forward+backward (loss = o.sum())")
    load0 = os.getloadavg()[0]
    peak = matmul_gflops()

    ours = lambda **kw: chunk_kda(**kw, chunk_size=C, backend="torch")  # noqa: E731
    fwd_bwd(ours, inputs)  # warm-up
    ours_t, o_ours = [], None
    for _ in range(args.reps):
        t, o_ours = fwd_bwd(ours, inputs)
        ours_t.append(t)
    rows = [("ours: chunk_kda (torch)", ours_t, None)]

    peers = [("fla naive_chunk_kda", lambda **kw: naive.naive_chunk_kda(**kw, chunk_size=C))]
    if not args.skip_recurrent:
        peers.append(("fla naive_recurrent_kda", naive.naive_recurrent_kda))
    for name, fn in peers:
        times, err = [], None
        for _ in range(args.peer_reps):
            t, o = fwd_bwd(fn, inputs)
            times.append(t)
            err = ((o - o_ours).abs().max() / o.abs().max()).item()
        rows.append((name, times, err))
    load1 = os.getloadavg()[0]

    flops = kda_chunk_flops(T, H, K, V, C)
    ours_med = statistics.median(ours_t)
    print(f"fp32 matmul throughput (2048^3, best of 3): {peak:.1f} GFLOP/s")
    print(f"chunked-algorithm FLOPs (fwd+bwd): {flops / 1e9:.2f} GFLOP -> ours {flops / min(ours_t) / 1e9:.1f} "
          f"GFLOP/s = {flops / min(ours_t) / 1e9 / peak:.0%} of the matmul throughput (best rep)")
    print(f"load average (1 min) before/after: {load0:.2f} / {load1:.2f}")
    print()
    print("| implementation | reps | median s | best s | max rel diff of o vs ours | ratio (peer / ours, median) |")
    print("|---|---|---|---|---|---|")
    for name, times, err in rows:
        med = statistics.median(times)
        diff = "-" if err is None else f"{err:.1e}"
        print(f"| {name} | {len(times)} | {med:.3f} | {min(times):.3f} | {diff} | {med / ours_med:.1f} |")


if __name__ == "__main__":
    main()
