"""The K3 model family as single-device PyTorch modules (megatron_k3.parallel parallelises them from outside)."""

from .k3 import CausalLMOutput, K3ForCausalLM, K3Model

__all__ = ["K3ForCausalLM", "K3Model", "CausalLMOutput"]
