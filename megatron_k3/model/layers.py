"""nn.Linear and nn.Embedding whose constructors leave the weight uninitialised: the model's init
(`megatron_k3.model.k3.init_weights`) sets every parameter, so a default init would only consume the random
stream. They are plain nn.Linear / nn.Embedding in every other respect (tensor parallelism substitutes them from
outside, megatron_k3.parallel.tensor).

`recomputing()` tells a forward that autograd's backward is running it again (activation recomputation,
megatron_k3.parallel.recompute): what a forward records besides its output (router statistics, load counts, depth
weights) is recorded by the first pass only, so it happens once per micro-batch whatever the recomputation."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Linear", "Embedding", "recomputing"]


def recomputing() -> bool:
    """True while autograd's backward re-runs a forward (a recomputed region); False in a forward pass. Inside a
    compiled region it is decided outside the graph (training.compile hands the records out), so it reads False."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class Linear(nn.Linear):
    def reset_parameters(self) -> None:  # the model's init sets the weight
        pass

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head's projection of a token tile (parallel.tiling); an adapted head (megatron_k3.peft) adds to it."""
        return nn.functional.linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:  # the model's init sets the weight
        pass
