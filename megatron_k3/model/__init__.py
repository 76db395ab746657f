"""The K3 model family as single-device PyTorch modules (megatron_k3.parallel parallelises them from outside)."""

from .k3 import CausalLMOutput, K3ForCausalLM, K3Model
from .multimodal import K3ForConditionalGeneration, causal_lm_class

__all__ = ["K3ForCausalLM", "K3ForConditionalGeneration", "K3Model", "CausalLMOutput", "causal_lm_class"]
