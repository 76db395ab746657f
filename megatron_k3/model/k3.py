"""K3Model and K3ForCausalLM: embedding, the configured layer schedule, output depth mix, final norm,
LM head. The same classes express Kimi Linear through config switches (see megatron_k3.config).

Legend: B batch, T tokens, D hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..parallel.context import SequenceShard, current_cp
from ..parallel.layers import (ColumnParallelLinear, VocabParallelEmbedding, current_tp, full_shape,
                               mark_adamw_only, mark_partial_grad, shard_tensor, vocab_parallel_cross_entropy)
from ..parallel.mappings import all_reduce_grad_hook, gather_last
from .cache import InferenceCache
from .decoder import DecoderLayer, DepthMix, ResidualState
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
        self.tp = tp = current_tp()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp)
        mark_adamw_only(self.embed_tokens.weight, "embedding")
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res:
            self.output_attn_res = DepthMix(cfg.hidden_size, cfg.rms_norm_eps)
        if tp.size > 1 and tp.sequence_parallel:  # applied to this rank's sequence shard only
            for m in [self.norm] + ([self.output_attn_res] if cfg.attn_res else []):
                for p in m.parameters():
                    mark_partial_grad(p)

    def numbered_layers(self):
        """(global layer index, layer) of the layers this module holds: all of them, or one pipeline stage's."""
        if isinstance(self.layers, nn.ModuleDict):
            return [(int(k), m) for k, m in self.layers.items()]
        return list(enumerate(self.layers))

    def keep_stage(self, start: int, end: int, first: bool, last: bool):
        """Drop everything outside one pipeline stage: layers [start, end) stay under their global names
        (`layers.{i}`), the embedding only on the first stage, the output mix and final norm on the last."""
        self.layers = nn.ModuleDict({str(i): self.layers[i] for i in range(start, end)})
        if not first:
            self.embed_tokens = None
        if not last:
            self.norm = None
            if self.cfg.attn_res:
                self.output_attn_res = None

    def forward(self, input_ids_BT: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                cache: InferenceCache | None = None, context: SequenceShard | None = None,
                state_in: ResidualState | None = None):
        """context: under context parallelism, input_ids_BT are this rank's tokens and `context` says where
        they sit in the sequence (cu_seqlens is then None: the shard holds the document boundaries).
        Under pipeline parallelism a stage without the embedding starts from `state_in` (the previous stage's
        ResidualState), and a stage without the final norm returns its ResidualState."""
        if self.tp.sequence_parallel and cache is not None:
            raise ValueError("sequence parallelism is for training; decode with parallel.sequence_parallel=false")
        if self.embed_tokens is not None:
            h = self.embed_tokens(input_ids_BT)  # [B, T/tp, D] under sequence parallelism
            st = ResidualState(blocks=[], partial=h) if self.cfg.attn_res else ResidualState(hidden=h)
        else:
            st = state_in
        for i, layer in self.numbered_layers():
            st = layer(st, cu_seqlens=cu_seqlens, cache_state=cache.layers[i] if cache is not None else None,
                       context=context)
        if self.norm is None:
            return st
        h = self.output_attn_res(st.blocks + [st.partial]) if self.cfg.attn_res else st.hidden
        if cache is not None:
            cache.seen_tokens += input_ids_BT.shape[1]
        return self.norm(h)


class K3ForCausalLM(nn.Module):
    def __init__(self, cfg, init: bool = True, stage: tuple | None = None):
        """stage: (start, end, first, last) keeps one pipeline stage (parallel/pipeline.py). The whole model is
        built and initialised first, so every stage starts from exactly the single-process weights."""
        super().__init__()
        self.cfg = cfg
        self.tp = tp = current_tp()
        self.cp = current_cp()
        self.model = K3Model(cfg)
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, tp=tp)  # vocabulary-parallel
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            mark_adamw_only(self.lm_head.weight, "lm_head")
        if tp.size > 1:  # replicated parameters with per-rank partial gradients are summed over TP
            for p in self.parameters():
                if getattr(p, "tp_partial_grad", False):
                    p.register_hook(all_reduce_grad_hook(tp.group))
        if init:
            self.reset_parameters()
        if stage is not None:
            start, end, first, last = stage
            if cfg.tie_word_embeddings and not (first and last):
                raise ValueError("tied embeddings need the embedding and the LM head on one stage")
            self.model.keep_stage(start, end, first, last)
            if not last:
                self.lm_head = None

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None):
        """Initialise every parameter from its full (unsharded) value, drawn in parameter order, and keep this
        rank's slice, so any tensor-parallel layout starts from exactly the single-process weights:
        normal(0, initializer_range) for matrices, embeddings and experts, ones for norms, zeros for the
        AttnRes pseudo-queries and the router bias, and the KDA gate/conv init."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.cfg.initializer_range
        depth_mix_projs = {id(m.proj) for m in self.modules() if isinstance(m, DepthMix)}
        owner = {}
        for mname, m in self.named_modules():
            for pname, p in m.named_parameters(recurse=False):
                owner[id(p)] = (m, pname)
        for name, p in self.named_parameters():
            m, pname = owner[id(p)]
            shape = full_shape(p, self.tp)
            full = None
            if isinstance(m, KimiDeltaAttention):
                full = m.init_full(pname, shape, gen)
            if full is None:
                if isinstance(m, RMSNorm):
                    full = torch.ones(shape)
                elif id(m) in depth_mix_projs:
                    full = torch.zeros(shape)
                elif pname == "bias":
                    full = torch.zeros(shape)
                else:
                    full = torch.empty(shape).normal_(0.0, std, generator=gen)
            p.copy_(shard_tensor(full, p, self.tp))
        for m in self.modules():
            if isinstance(m, TopKRouter):
                m.e_score_correction_bias.zero_()

    def load_full_state_dict(self, full: dict, strict: bool = True):
        """Load an unsharded (single-process) state dict, keeping this rank's slice of each tensor."""
        own = self.state_dict()
        missing = [k for k in own if k not in full]
        unexpected = [k for k in full if k not in own]
        if strict and (missing or unexpected):
            raise KeyError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        params = dict(self.named_parameters())
        sharded = {k: (shard_tensor(v, params[k], self.tp) if k in params else v) for k, v in full.items() if k in own}
        return self.load_state_dict(sharded, strict=strict)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, cache: InferenceCache | None = None,
                return_logits: bool | None = None, state_in: ResidualState | None = None) -> CausalLMOutput:
        """input_ids [B, T]; labels [B, T] aligned with the inputs (label t is the token after t; -100 is
        ignored); cu_seqlens: document offsets of a packed row (B = 1). Under tensor parallelism the logits
        are vocabulary-sharded and the loss is the vocab-parallel cross-entropy; full logits are gathered
        only when asked for (return_logits, default: when no labels are given).

        Under context parallelism (parallel.cp > 1) every CP rank passes the whole sequence; the model keeps its
        zigzag share of the tokens (parallel/context.py), the logits are those of its own tokens in its local
        order, and the loss has the whole sequence's mean as its value and this rank's share of it as its
        gradient.

        A pipeline stage (built with `stage`) takes the previous stage's ResidualState as `state_in` (not on the
        first stage) and returns its own ResidualState instead of an output (not on the last stage)."""
        context = None
        if self.cp.size > 1:
            if cache is not None:
                raise ValueError("context parallelism is for training and prefill; decode with parallel.cp=1")
            context = SequenceShard(self.cp, input_ids.shape[1], cu_seqlens, input_ids.device)
            input_ids, cu_seqlens = context.take(input_ids), None
            labels = context.take(labels) if labels is not None else None
        h = self.model(input_ids, cu_seqlens=cu_seqlens, cache=cache, context=context, state_in=state_in)
        if self.lm_head is None:  # a pipeline stage before the last: its ResidualState goes on
            return h
        logits = self.lm_head(self.tp.enter(h))  # [B, T, V/tp]
        loss = None
        if labels is not None:
            loss = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), self.tp,
                                                self.tp.rank * logits.shape[-1])
            if context is not None:
                loss = context.global_mean(loss, (labels != -100).sum())
        if return_logits is None:
            return_logits = labels is None
        if self.tp.size > 1:
            logits = gather_last(logits, self.tp.group) if return_logits else None
        return CausalLMOutput(logits=logits, loss=loss, cache=cache)

    @classmethod
    def from_hf(cls, path, layout: str = "auto", config=None) -> "K3ForCausalLM":
        """Load a Hugging Face directory (layout "auto", "kimi_linear" or "k3"; megatron_k3.interop.hf)."""
        from ..interop.hf import load_hf

        return load_hf(path, layout, config)

    def save_hf(self, path, layout: str = "k3", **kwargs):
        """Write this model as a Hugging Face directory (layout "k3" or "kimi_linear"; megatron_k3.interop.hf)."""
        from ..interop.hf import save_hf

        return save_hf(self, path, layout, **kwargs)

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


