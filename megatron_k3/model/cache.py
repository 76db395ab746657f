"""Inference state for prefill + token-by-token decode: per KDA layer the short-conv caches and the
recurrent state; per MLA layer the compressed latent cache (absorbed form)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KDAState:
    conv_q: torch.Tensor | None = None  # [B, W-1, H*K]
    conv_k: torch.Tensor | None = None
    conv_v: torch.Tensor | None = None
    recurrent: torch.Tensor | None = None  # [B, H, K, V] fp32


@dataclass
class MLAState:
    latent: torch.Tensor | None = None  # [B, T_seen, kv_lora_rank], after kv_a_layernorm
    k_rope: torch.Tensor | None = None  # [B, T_seen, qk_rope_head_dim], the head-shared key part

    @property
    def length(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]


@dataclass
class InferenceCache:
    layers: list = field(default_factory=list)
    seen_tokens: int = 0

    @classmethod
    def for_model(cls, cfg) -> "InferenceCache":
        return cls([MLAState() if t == "mla" else KDAState() for t in cfg.layer_types()])
