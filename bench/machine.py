"""The machine line every benchmark prints above its table: CPU model, cores, Python, torch (and its threads); and
`timed_fwd_bwd`, one timed forward+backward of a layer on every rank of a gloo world (the MoE benches)."""

from __future__ import annotations

import os
import platform
import subprocess

import torch


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001 - description only
        pass
    return (f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads)")


def timed_fwd_bwd(layer, x):
    """(seconds, output, input gradient) of one forward+backward of `layer` on a copy of x, loss out.square().mean(),
    after a barrier (every rank starts together); gradients reset first."""
    import time

    import torch.distributed as dist

    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    dist.barrier()
    t0 = time.perf_counter()
    y = layer(xi)
    y.square().mean().backward()
    return time.perf_counter() - t0, y.detach(), xi.grad
