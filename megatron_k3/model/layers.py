"""nn.Linear and nn.Embedding whose constructors leave the weight uninitialised: the model's init
(`megatron_k3.model.k3.init_weights`) sets every parameter, so a default init would only consume the random
stream. They are plain nn.Linear / nn.Embedding in every other respect (tensor parallelism substitutes them from
outside, megatron_k3.parallel.tensor)."""

from __future__ import annotations

from torch import nn

__all__ = ["Linear", "Embedding"]


class Linear(nn.Linear):
    def reset_parameters(self) -> None:  # the model's init sets the weight
        pass


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:  # the model's init sets the weight
        pass
