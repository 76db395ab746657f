"""Benchmark: a MoE layer under expert parallelism (gloo, one thread per rank) with the shared experts overlapping
the dispatch all-to-all (the default) against the same layer run sequentially, in one run, round-robin.

    .venv/bin/python bench/moe_overlap.py [--ep 2 --tokens 4096 --hidden 256 --experts 32 --top-k 4 --inter 128
                                           --shared 1024 --reps 20 --port 29731]

Forward+backward, loss = out.square().mean(). Also times the pieces alone (the shared experts' forward+backward,
and an all-to-all of the dispatch buffer in each direction): the most overlap can save is the smaller of the two.
Results are bit-identical between the two forms (checked every repetition).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from machine import timed_fwd_bwd  # noqa: E402  (bench/machine.py)


def worker(rank, a, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=a.ep)
    from megatron_k3.config import load_model_config
    from megatron_k3.model.dispatcher import capacity
    from megatron_k3.model.moe import StableLatentMoE
    from megatron_k3.parallel import ParallelGroups, parallelize, state
    from megatron_k3.parallel import experts as dispatcher
    from megatron_k3.parallel.mappings import all_to_all

    ps = state.initialize_model_parallel(ep=a.ep)
    cfg = load_model_config("k3_tiny", [f"hidden_size={a.hidden}", f"num_experts={a.experts}", f"top_k={a.top_k}",
                                        f"moe_intermediate_size={a.inter}", "moe_latent_size=0",
                                        "moe_latent_norm=false", f"shared_intermediate_size={a.shared}",
                                        "moe_overflow=drop", "moe_capacity_factor=1.25"])
    torch.manual_seed(0)
    moe = parallelize(StableLatentMoE(cfg), ParallelGroups.from_state(ps))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    torch.manual_seed(1 + rank)
    x = torch.randn(1, a.tokens, a.hidden)
    overlapped = dispatcher.all_to_all_overlapped

    def sequential(t, group, side):
        return all_to_all(t, group), side()

    def step(mode):
        dispatcher.all_to_all_overlapped = overlapped if mode == "overlapped" else sequential
        try:
            return timed_fwd_bwd(moe, x)
        finally:
            dispatcher.all_to_all_overlapped = overlapped

    def shared_only():
        xi = x.clone().requires_grad_(True)
        t0 = time.perf_counter()
        moe.shared_experts(xi).square().mean().backward()
        return time.perf_counter() - t0

    buf = torch.randn(a.experts * capacity(a.tokens, a.top_k, a.experts, 1.25) * a.hidden)

    def a2a_only():
        out = torch.empty_like(buf)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(out, buf)
        dist.all_to_all_single(out, buf)  # and back (the backward's reverse is the same size)
        return time.perf_counter() - t0

    times = {"overlapped": [], "sequential": [], "shared experts alone (fwd+bwd)": [],
             "dispatch all-to-all, fwd+bwd": []}
    for r in range(a.reps + 3):
        res = {}
        for mode in ("overlapped", "sequential"):
            dt, y, g = step(mode)
            res[mode] = (y, g)
            if r >= 3:
                times[mode].append(dt)
        assert torch.equal(res["overlapped"][0], res["sequential"][0]) and \
            torch.equal(res["overlapped"][1], res["sequential"][1]), "overlap changed the result"
        if r >= 3:
            times["shared experts alone (fwd+bwd)"].append(shared_only())
            times["dispatch all-to-all, fwd+bwd"].append(a2a_only())
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratios = [s / o for s, o in zip(times["sequential"], times["overlapped"])]
    q.put((rank, med, statistics.median(ratios), min(ratios), max(ratios)))
    state.destroy_model_parallel()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    for name, default in (("ep", 2), ("tokens", 4096), ("hidden", 256), ("experts", 32), ("top-k", 4), ("inter", 128),
                          ("shared", 1024), ("reps", 20), ("port", 29731)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, a, q)) for r in range(a.ep)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    print(f"ep={a.ep} (gloo, 1 thread per rank), {a.tokens} tokens per rank, hidden {a.hidden}, {a.experts} experts "
          f"top-{a.top_k} width {a.inter}, shared expert width {a.shared}, capacity factor 1.25, fp32, {a.reps} reps")
    print("| rank | overlapped ms | sequential ms | sequential / overlapped (median, range) | shared alone ms | "
          "all-to-all alone ms |\n|---|---|---|---|---|---|")
    for rank, med, r_med, r_min, r_max in results:
        print(f"| {rank} | {med['overlapped']:.1f} | {med['sequential']:.1f} | {r_med:.3f} ({r_min:.2f}-{r_max:.2f}) | "
              f"{med['shared experts alone (fwd+bwd)']:.1f} | {med['dispatch all-to-all, fwd+bwd']:.1f} |")


if __name__ == "__main__":
    main()
