#!/usr/bin/env python
"""How far a step's routed-expert gradient is from the exact sum of its micro-batches' gradients, accumulated in
fp32 (precision.grad_accum_dtype=fp32, the default) and in bf16 (=bf16), through training.expert_optimizer's
ExpertOptimizer as the Trainer runs it under expert parallelism: a bf16 expert tensor, one backward per micro-batch
whose gradient is that micro-batch's bf16 gradient, then `reduce_gradients`. The reference is the float64 sum of
the same bf16 gradients, so the error is the accumulation's alone.

Each micro-batch's gradient is a shared direction plus per-micro-batch noise of `--noise` times its size (the
micro-batches of one step agree on a mean and differ by their tokens), drawn in fp32 and rounded to bf16.

    .venv/bin/python bench/grad_accumulation.py [--micro-batches 8 64 512] [--noise 1.0] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_k3.layout.grid import GROUPS, RankGrid  # noqa: E402
from megatron_k3.parallel.state import ParallelState  # noqa: E402
from megatron_k3.training.expert_optimizer import ExpertOptimizer  # noqa: E402

SHAPE = (8, 128, 256)  # 8 local experts of a 128 x 256 matrix


def accumulated(grads, fp32: bool) -> torch.Tensor:
    """The step's gradient ExpertOptimizer hands its optimizer after one backward per entry of `grads`."""
    ps = ParallelState(RankGrid(1), 0, {name: None for name in GROUPS})
    w = torch.nn.Parameter(torch.zeros(SHAPE, dtype=torch.bfloat16))
    ex = ExpertOptimizer([("experts.w1", w)], lambda ms: torch.optim.SGD([m for _, m in ms], lr=0.0), ps,
                         torch.device("cpu"), fp32_accumulation=fp32)
    for g in grads:
        (w.float() * g.float()).sum().backward()  # the gradient of w is g, exactly, in w's dtype
    ex.reduce_gradients()
    return ex.masters[0].grad


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--noise", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(f"{'micro-batches':>13} {'fp32 accumulation':>18} {'bf16 accumulation':>18} {'bf16 / fp32':>12}")
    for n in args.micro_batches:
        gen = torch.Generator().manual_seed(args.seed)
        mean = torch.randn(SHAPE, generator=gen)
        grads = [(mean + args.noise * torch.randn(SHAPE, generator=gen)).bfloat16() for _ in range(n)]
        ref = torch.stack([g.double() for g in grads]).sum(0)
        err = {}
        for fp32 in (True, False):
            got = accumulated(grads, fp32).double()
            err[fp32] = float((got - ref).norm() / ref.norm())
        ratio = f"{err[False] / err[True]:.1e}" if err[True] else "-"  # one micro-batch: both exact
        print(f"{n:>13} {err[True]:>18.2e} {err[False]:>18.2e} {ratio:>12}")


if __name__ == "__main__":
    main()
