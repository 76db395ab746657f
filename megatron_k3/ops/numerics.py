"""The dtype rules every op shares: numerically sensitive math runs in fp32, and fp64 inputs (the reference
tests) stay fp64."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["atleast_fp32", "autocast_input", "compute_dtype", "in_dtype", "sq_norm64", "start_cpu_threads",
           "without_autocast"]


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """x in the autocast dtype where an autocast of its device is on and x is fp32, as torch.autocast casts a
    linear's input: for the GEMMs autocast does not list (torch._grouped_mm, our grouped GEMM Functions), which would
    otherwise run in fp32 on an fp32 input (a model without the latent projection feeds the experts the fp32
    residual stream). x itself otherwise."""
    kind = x.device.type
    if x.dtype == torch.float32 and torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return x.to(torch.get_autocast_dtype(kind))
    return x


def without_autocast(device_type: str):
    """A context in which torch.autocast leaves `device_type`'s ops in the dtypes they are given: for math done in
    fp32 on purpose (the router's scores, KDA's torch path, the vision tower's table interpolation), whose GEMMs,
    matmuls and einsums a bf16 autocast around the forward would otherwise run in bf16. Nothing for a device type
    without autocast (meta, where the planner builds)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def atleast_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or unchanged if it is already fp64 (reference tests run in fp64)."""
    return x if x.dtype == torch.float64 else x.float()


def compute_dtype(*xs) -> torch.dtype:
    """The dtype for numerically sensitive math: fp32, or fp64 when any given tensor is fp64."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def in_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`: x itself when it already is, not `x.to(dtype)` (a no-op alias of it). For what an
    autograd.Function's forward returns: torch 2.11's Dynamo gives a Function output that is a no-op `.to` of a tensor
    made in the forward, or a tensor the forward changed in place, no gradient (silently zero under torch.compile;
    eager and torch 2.13 are right; pytorch issues 180642, 184113). tests/test_compiled_functions.py compiles each
    of our Functions against eager (`make test-device-torch` runs it under 2.11)."""
    return x if x.dtype == dtype else x.to(dtype)


SQ_NORM_CHUNK = 1 << 22  # elements: 32 MB of float64 per temporary


def sq_norm64(t: torch.Tensor) -> torch.Tensor:
    """sum(t ** 2) in float64 (a 0-dim tensor on t's device), chunk by chunk, so that the float64 temporaries stay at
    two of SQ_NORM_CHUNK elements whatever t's size (a whole 1e9-element expert gradient would need 16 GB). Squares of
    fp32 or bf16 values are exact in float64; only the summation order differs from one whole sum (1e-16 relative)."""
    flat = t.detach().reshape(-1)
    out = torch.zeros((), dtype=torch.float64, device=t.device)
    for c in flat.split(SQ_NORM_CHUNK):
        out += c.double().pow(2).sum()
    return out


def start_cpu_threads() -> None:
    """Run a throwaway parallel exp on the CPU, so that the process's first parallel region computes nothing that
    counts. torch 2.13's CPU build (measured on an AVX-512 Sapphire Rapids Xeon at 2 threads): in 1 of 3 to 12
    processes the first parallel torch.exp of the process computed the worker thread's share with up to 1.5e-4
    relative error (its second call was right, and so was the first after any earlier parallel op), which made two
    runs of the same computation differ. A few microseconds; nothing to do on one thread."""
    if torch.get_num_threads() > 1:
        torch.exp(torch.zeros(1 << 17))
