"""The dtype rules every op shares: numerically sensitive math runs in fp32, and fp64 inputs (the reference
tests) stay fp64."""

from __future__ import annotations

import torch

__all__ = ["atleast_fp32", "compute_dtype"]


def atleast_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or unchanged if it is already fp64 (reference tests run in fp64)."""
    return x if x.dtype == torch.float64 else x.float()


def compute_dtype(*xs) -> torch.dtype:
    """The dtype for numerically sensitive math: fp32, or fp64 when any given tensor is fp64."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32
