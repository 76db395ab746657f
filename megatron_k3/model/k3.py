"""K3Model and K3ForCausalLM: embedding, the configured layer schedule, output depth mix, final norm,
LM head. The same classes express Kimi Linear through config switches (see megatron_k3.config).

Legend: B batch, T tokens, D hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .cache import InferenceCache
from .decoder import DecoderLayer, DepthMix, ResidualState
from .experts import GroupedExperts
from .kda import KimiDeltaAttention
from .moe import StableLatentMoE
from .norm import RMSNorm
from .router import TopKRouter


@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None
    cache: InferenceCache | None = None


class K3Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res:
            self.output_attn_res = DepthMix(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids_BT: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                cache: InferenceCache | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids_BT)
        st = ResidualState(blocks=[], partial=h) if self.cfg.attn_res else ResidualState(hidden=h)
        for i, layer in enumerate(self.layers):
            st = layer(st, cu_seqlens=cu_seqlens, cache_state=cache.layers[i] if cache is not None else None)
        h = self.output_attn_res(st.blocks + [st.partial]) if self.cfg.attn_res else st.hidden
        if cache is not None:
            cache.seen_tokens += input_ids_BT.shape[1]
        return self.norm(h)


class K3ForCausalLM(nn.Module):
    def __init__(self, cfg, init: bool = True):
        super().__init__()
        self.cfg = cfg
        self.model = K3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if init:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None):
        """normal(0, initializer_range) for every matrix and expert weight, ones for norms, zeros for the
        AttnRes pseudo-queries and the router bias, and the KDA gate/conv init of the KDA layer."""
        gen = None
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
        std = self.cfg.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, std, generator=gen)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
            elif isinstance(m, GroupedExperts):
                for w in (m.w1, m.w2, m.w3):
                    w.normal_(0.0, std, generator=gen)
            elif isinstance(m, TopKRouter):
                m.weight.normal_(0.0, std, generator=gen)
                m.e_score_correction_bias.zero_()
            elif isinstance(m, KimiDeltaAttention):
                m.reset_kda_parameters(gen)
                m.o_norm.fill_(1.0)
        for m in self.modules():  # pseudo-queries start at zero: uniform depth weights at init
            if isinstance(m, DepthMix):
                m.proj.weight.zero_()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, cache: InferenceCache | None = None) -> CausalLMOutput:
        """input_ids [B, T]; labels [B, T] aligned with the inputs (label t is the token after t; -100 is
        ignored); cu_seqlens: document offsets of a packed row (B = 1)."""
        h = self.model(input_ids, cu_seqlens=cu_seqlens, cache=cache)
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return CausalLMOutput(logits=logits, loss=loss, cache=cache)

    def new_cache(self) -> InferenceCache:
        return InferenceCache.for_model(self.cfg)

    @torch.no_grad()
    def generate_logits(self, input_ids: torch.Tensor, prefill: int) -> torch.Tensor:
        """Prefill the first `prefill` tokens, then decode the rest one token at a time (teacher-forced);
        returns the logits of every position, [B, T, V]. Used by tests and evaluation."""
        cache = self.new_cache()
        out = [self(input_ids[:, :prefill], cache=cache).logits]
        for t in range(prefill, input_ids.shape[1]):
            out.append(self(input_ids[:, t:t + 1], cache=cache).logits)
        return torch.cat(out, dim=1)

    def moe_layers(self):
        return [m for m in self.modules() if isinstance(m, StableLatentMoE)]

