"""SiTU-GLU (K3) and SwiGLU activations, and the gated MLP used for dense layers and shared experts.

SiTU(g) = b1 * tanh(g / b1) * sigmoid(g): SiLU with its linear factor soft-capped at b1.
SiTU-GLU(g, u) = SiTU(g) * b2 * tanh(u / b2), bounded by b1 * b2. Computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.layers import ColumnParallelLinear, RowParallelLinear, current_tp, mark_expert_blocks
from .norm import atleast_fp32


def situ(g: torch.Tensor, beta: float = 4.0) -> torch.Tensor:
    gf = atleast_fp32(g)
    return beta * torch.tanh(gf / beta) * torch.sigmoid(gf)


def glu_act(gate: torch.Tensor, up: torch.Tensor, act: str, beta_gate: float = 4.0, beta_up: float = 25.0):
    """The gated activation h = act(gate) * f(up), in fp32, returned in gate's dtype."""
    if act == "situ":
        h = situ(gate, beta_gate) * (beta_up * torch.tanh(atleast_fp32(up) / beta_up))
    elif act == "silu":
        h = F.silu(atleast_fp32(gate)) * atleast_fp32(up)
    else:
        raise ValueError(f"unknown activation {act!r}; valid: 'situ', 'silu'")
    return h.to(gate.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): the dense FFN of layer 0 and the shared experts. Megatron-style under
    tensor parallelism: gate/up column-parallel, down row-parallel. `experts` > 1: the intermediate width is
    that many fused experts (K3's 2 shared experts), which the optimizer treats as separate matrices."""

    def __init__(self, dim: int, inter: int, act: str, beta_gate: float = 4.0, beta_up: float = 25.0, tp=None,
                 experts: int = 1):
        super().__init__()
        self.tp = tp or current_tp()
        self.gate_proj = ColumnParallelLinear(dim, inter, tp=self.tp)
        self.up_proj = ColumnParallelLinear(dim, inter, tp=self.tp)
        self.down_proj = RowParallelLinear(inter, dim, tp=self.tp)
        if experts > 1 and inter % experts == 0:
            mark_expert_blocks(self.gate_proj.weight, experts, axis=0)
            mark_expert_blocks(self.up_proj.weight, experts, axis=0)
            mark_expert_blocks(self.down_proj.weight, experts, axis=1)
        self.act, self.beta_gate, self.beta_up = act, beta_gate, beta_up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tp.enter(x)
        return self.down_proj(glu_act(self.gate_proj(x), self.up_proj(x), self.act, self.beta_gate, self.beta_up))
