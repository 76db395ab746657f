"""The gated MLP: down(act(gate(x)) * up(x)) with SiTU-GLU (K3) or SwiGLU (ops.glu), for the dense FFN of
layer 0 and the shared experts.

Legend: D hidden, I intermediate.
"""

from __future__ import annotations

import torch
from torch import nn

from ..annotations import annotate
from ..ops.glu import glu_act
from .layers import Linear


class GatedMLP(nn.Module):
    """`experts` > 1: the intermediate width is that many fused experts (K3's 2 shared experts), which the optimizer
    treats as separate matrices."""

    def __init__(self, dim: int, inter: int, act: str, beta_gate: float = 4.0, beta_up: float = 25.0,
                 experts: int = 1):
        super().__init__()
        self.gate_proj = Linear(dim, inter, bias=False)
        self.up_proj = Linear(dim, inter, bias=False)
        self.down_proj = Linear(inter, dim, bias=False)
        if experts > 1 and inter % experts == 0:
            annotate(self.gate_proj.weight, blocks=experts, block_axis=0, block_kind="experts")
            annotate(self.up_proj.weight, blocks=experts, block_axis=0, block_kind="experts")
            annotate(self.down_proj.weight, blocks=experts, block_axis=1, block_kind="experts")
        self.act, self.beta_gate, self.beta_up = act, beta_gate, beta_up

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x_BTD), self.up_proj(x_BTD)))

    def activation(self, gate_BTI: torch.Tensor, up_BTI: torch.Tensor) -> torch.Tensor:
        """The gated activation between the projections (what selective recomputation's `mlp_act` rebuilds)."""
        return glu_act(gate_BTI, up_BTI, self.act, self.beta_gate, self.beta_up)
