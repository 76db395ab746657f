#!/usr/bin/env python
"""Shard-local initialisation (megatron_k3/ops/init.py) against the two ways peers initialise a sharded parameter,
on the shards one rank of full-size K3 holds, in one process, interleaved:

  ours        fill_: the rank's block of each parameter from counter-based tiles; the same values in every layout
  shard       torch's generator drawn over the rank's shard only (Megatron-LM's GPU initialisation under its
              model-parallel RNG tracker, torchtitan's init_weights on a DTensor shard): proportional to the shard,
              but the values depend on the layout
  full+slice  the whole parameter drawn and the rank's slice kept (Megatron-LM's `use_cpu_initialization`,
              `_initialize_affine_weight_cpu`): layout-independent, proportional to the full parameter

The shards are those of one decoder layer of rank R of a layout (default: rank 0 of tp8 pp8 ep64 on
supernodes_8x64, layer 1: a KDA layer with its Stable LatentMoE, 14 of 896 experts) plus the rank's embedding
shard, built on the meta device by tools/build_rank.py's code. All three draw normal(0, 0.02) in fp32 on the CPU.
The ratio columns are time over `shard`'s time; `ns/elem` is per element the rank keeps.

    .venv/bin/python bench/init.py [--reps 3] [--layer 1] [--rank 0] [--full-limit-gb 2] [overrides ...]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from megatron_k3.ops.init import fill_, normal  # noqa: E402
from megatron_k3.planning.dry_run import build_rank  # noqa: E402
from megatron_k3.planning.run import compose_for_planning  # noqa: E402

LAYOUT = ["model=k3", "cluster=supernodes_8x64", "parallel.tp=8", "parallel.pp=8", "parallel.ep=64",
          "parallel.sequence_parallel=true"]


def ours(name, full, offsets, shape):
    return fill_(torch.empty(shape), normal(0.02), 0, name, full, offsets)


def shard(name, full, offsets, shape):
    g = torch.Generator().manual_seed(hash(name) & 0xFFFF)
    return torch.empty(shape).normal_(0.0, 0.02, generator=g)


def full_slice(name, full, offsets, shape):
    g = torch.Generator().manual_seed(hash(name) & 0xFFFF)
    t = torch.empty(full).normal_(0.0, 0.02, generator=g)
    return t[tuple(slice(o, o + n) for o, n in zip(offsets, shape))].clone()


METHODS = {"ours": ours, "shard": shard, "full+slice": full_slice}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--full-limit-gb", type=float, default=2.0)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    run = compose_for_planning(LAYOUT + a.overrides)[0]
    world = run.cluster.num_nodes * run.cluster.devices_per_node
    built = build_rank(run, world, a.rank)
    prefix = f"model.layers.{a.layer}."
    blocks = {n: b for n, b in built.blocks.items() if n.startswith(prefix) or "embed_tokens" in n}
    if not any(n.startswith(prefix) for n in blocks):
        raise SystemExit(f"--layer {a.layer}: rank {a.rank} holds layers {built.layers}")
    kept = sum(math.prod(s) for _, _, s in blocks.values())
    whole = sum(math.prod(f) for f, _, _ in blocks.values())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; rank {a.rank} of {world} "
          f"({' '.join(a.overrides) or 'tp8 pp8 ep64'}): layer {a.layer} + embedding shard, {len(blocks)} tensors, "
          f"{kept / 1e6:.1f}M elements kept of {whole / 1e6:.1f}M full")
    # full+slice cannot draw a full routed-expert stack here (896 experts of one layer: ~39 GB in fp32): it is
    # timed on the tensors whose full size fits under --full-limit-gb, the other two on those and on everything
    small = {n: b for n, b in blocks.items() if math.prod(b[0]) * 4 <= a.full_limit_gb * 1e9}
    for label, subset, methods in (("all tensors", blocks, ("ours", "shard")),
                                   (f"tensors whose full size is <= {a.full_limit_gb} GB", small, tuple(METHODS))):
        kept = sum(math.prod(s) for _, _, s in subset.values())
        times = {m: [] for m in methods}
        for _ in range(a.reps):
            for m in methods:
                t0 = time.perf_counter()
                for name, (full, offsets, shape) in subset.items():
                    METHODS[m](name, full, offsets, shape)
                times[m].append(time.perf_counter() - t0)
        base = statistics.median(times["shard"])
        print(f"\n{label}: {len(subset)} tensors, {kept / 1e6:.1f}M elements kept of "
              f"{sum(math.prod(f) for f, _, _ in subset.values()) / 1e6:.1f}M full")
        print(f"{'method':<12} {'median s':>9} {'ns/elem':>8} {'vs shard':>9}")
        for m, ts in times.items():
            t = statistics.median(ts)
            print(f"{m:<12} {t:>9.3f} {t / kept * 1e9:>8.2f} {t / base:>8.2f}x")
    big = max(blocks.items(), key=lambda kv: math.prod(kv[1][2]))
    print(f"largest shard: {big[0]} {big[1][2]} of {big[1][0]}")


if __name__ == "__main__":
    main()
