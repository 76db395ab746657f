"""Parameter-efficient fine-tuning (`peft=lora`): low-rank adapters applied from outside over a frozen base whose
routed experts stay in the release's MXFP4 encoding (docs/peft.md)."""

from .experts import FrozenExperts
from .lora import KINDS, adapted_parameters, apply_lora, check_targets, is_adapter, resolve_targets
from .tokens import check_tokens, token_ids

__all__ = ["FrozenExperts", "KINDS", "apply_lora", "check_targets", "resolve_targets", "adapted_parameters",
           "is_adapter", "check_tokens", "token_ids"]
