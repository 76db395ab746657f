"""K3Model and K3ForCausalLM: embedding, the configured layer schedule, output depth mix, final norm, LM head and
loss. The same classes express Kimi Linear through config switches (see megatron_k3.config).

Legend: B batch, T tokens, D hidden, V vocab.

Single-device code: megatron_k3.parallel applies tensor, sequence, context, expert and pipeline parallelism to a
built model from outside. A pipeline stage is this model with the modules of other stages removed (set to None,
the layers it keeps under their global indices); the forward passes below skip what is not there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..annotations import annotate
from .cache import InferenceCache
from .decoder import DecoderLayer, DepthMix, ResidualState
from .kda import KimiDeltaAttention
from .layers import Embedding, Linear
from .moe import StableLatentMoE
from .norm import RMSNorm
from .router import TopKRouter


@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None
    cache: InferenceCache | None = None


class CrossEntropy(nn.Module):
    """Mean cross-entropy over the non-ignored tokens (label -100), in fp32: logits [N, V], labels [N]."""

    ignore_index = -100

    def forward(self, logits_NV: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits_NV.float(), labels_N, ignore_index=self.ignore_index)


class K3Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        annotate(self.embed_tokens.weight, adamw_reason="embedding")
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res:
            self.output_attn_res = DepthMix(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids_BT: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None,
                cache: InferenceCache | None = None, state_in: ResidualState | None = None):
        """Without the embedding (a later pipeline stage) the layers start from `state_in`; without the final norm
        (an earlier stage) the ResidualState after the last layer is returned."""
        if self.embed_tokens is not None:
            h = self.embed_tokens(input_ids_BT)
            st = ResidualState(blocks=[], partial=h) if self.cfg.attn_res else ResidualState(hidden=h)
        else:
            st = state_in
        for layer in self.layers:
            st = layer(st, cu_seqlens=cu_seqlens,
                       cache_state=cache.layers[layer.layer_idx] if cache is not None else None)
        if self.norm is None:
            return st
        h = self.output_attn_res(st.blocks + [st.partial]) if self.cfg.attn_res else st.hidden
        if cache is not None:
            cache.seen_tokens += input_ids_BT.shape[1]
        return self.norm(h)


class K3ForCausalLM(nn.Module):
    def __init__(self, cfg, init: bool = True):
        """init: draw the initial weights (`reset_parameters`) from torch's default generator; without it the
        parameters are left uninitialised (to be loaded)."""
        super().__init__()
        self.cfg = cfg
        self.model = K3Model(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            annotate(self.lm_head.weight, adamw_reason="lm_head")
        self.loss_fn = CrossEntropy()
        if init:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None):
        """Initialise every parameter, drawn in parameter order from one generator (torch's default, or one seeded
        with `seed`): normal(0, initializer_range) for matrices, embeddings and experts, ones for norms, zeros for
        the AttnRes pseudo-queries, biases and the router bias, and the KDA gate/conv init. Call it on the
        unsharded model: megatron_k3.parallel shards the values it drew."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.cfg.initializer_range
        depth_mix_projs = {id(m.proj) for m in self.modules() if isinstance(m, DepthMix)}
        owner = {}
        for m in self.modules():
            for pname, p in m.named_parameters(recurse=False):
                owner[id(p)] = (m, pname)
        for p in self.parameters():
            m, pname = owner[id(p)]
            full = m.init_full(pname, p.shape, gen) if isinstance(m, KimiDeltaAttention) else None
            if full is None:
                if isinstance(m, RMSNorm):
                    full = torch.ones(p.shape)
                elif id(m) in depth_mix_projs or pname == "bias":
                    full = torch.zeros(p.shape)
                else:
                    full = torch.empty(p.shape).normal_(0.0, std, generator=gen)
            p.copy_(full)
        for m in self.modules():
            if isinstance(m, TopKRouter):
                m.e_score_correction_bias.zero_()

    def forward(self, input_ids: torch.Tensor | None, labels: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, cache: InferenceCache | None = None,
                return_logits: bool | None = None, state_in: ResidualState | None = None) -> CausalLMOutput:
        """input_ids [B, T]; labels [B, T] aligned with the inputs (label t is the token after t; -100 is
        ignored); cu_seqlens: document offsets of a packed row (B = 1). return_logits: whether the caller wants the
        logits (default: when no labels are given); one device always returns them.

        A pipeline stage without the LM head returns the ResidualState its last layer left (state_in: the previous
        stage's, on a stage without the embedding)."""
        h = self.model(input_ids, cu_seqlens=cu_seqlens, cache=cache, state_in=state_in)
        if self.lm_head is None:
            return h
        logits = self.lm_head(h)  # [B, T, V]
        loss = None
        if labels is not None:
            loss = self.loss_fn(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return CausalLMOutput(logits=logits, loss=loss, cache=cache)

    def new_cache(self) -> InferenceCache:
        return InferenceCache.for_model(self.cfg)

    @torch.no_grad()
    def generate_logits(self, input_ids: torch.Tensor, prefill: int) -> torch.Tensor:
        """Prefill the first `prefill` tokens, then decode the rest one token at a time (teacher-forced); returns the
        logits of every position, [B, T, V]. Used by tests and evaluation."""
        cache = self.new_cache()
        out = [self(input_ids[:, :prefill], cache=cache, return_logits=True).logits]
        for t in range(prefill, input_ids.shape[1]):
            out.append(self(input_ids[:, t:t + 1], cache=cache, return_logits=True).logits)
        return torch.cat(out, dim=1)

    def moe_layers(self):
        return [m for m in self.modules() if isinstance(m, StableLatentMoE)]
