"""RMSNorm and L2 normalisation, computed in fp32."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.numerics import atleast_fp32


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps); the normalisation runs in fp32, the result in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = atleast_fp32(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the eps sits inside the sum, as in fla's kernels)."""
    xf = atleast_fp32(x)
    return (xf / torch.sqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
