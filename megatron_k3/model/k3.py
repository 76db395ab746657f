"""K3Model and K3ForCausalLM: embedding, the configured layer schedule, output depth mix, final norm, LM head and
loss. The same classes express Kimi Linear through config switches (see megatron_k3.config).

Legend: B batch, T tokens, D hidden, V vocab.

Single-device code: megatron_k3.parallel applies tensor, sequence, context, expert and pipeline parallelism to a
built model from outside. A model part (a pipeline stage) is this model built with a range of its layers (under
their global indices), with or without the embedding and the output end (None where absent); the forward passes
below skip what is not there.

Initial values are a function of (seed, parameter name, global element index) (megatron_k3.ops.init): a model
built on the meta device, cut and sharded, then allocated (`materialize`) holds exactly the values the whole
single-device model would hold in that block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..annotations import annotate, full_shape, shard_offsets
from ..ops.init import Init, constant, fill_, normal
from ..ops.kda import seq_idx_from_cu_seqlens
from .cache import InferenceCache
from .decoder import DecoderLayer, DepthMix, LayerStack, ResidualState
from .kda import KimiDeltaAttention
from .layers import Embedding, Linear
from .moe import StableLatentMoE
from .norm import RMSNorm


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


def _layer_range(cfg, layers) -> range:
    layers = range(cfg.num_layers) if layers is None else range(layers.start, layers.stop)
    if not (0 <= layers.start <= layers.stop <= cfg.num_layers):
        raise ValueError(f"layers [{layers.start}, {layers.stop}) outside the model's {cfg.num_layers} layers")
    return layers


class K3Model(nn.Module):
    def __init__(self, cfg, layers: range | None = None, embedding: bool = True, head: bool = True):
        """layers: the global indices of the decoder layers to build (default all); embedding / head: build the
        token embedding / the output mix and final norm."""
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size) if embedding else None
        if embedding:
            annotate(self.embed_tokens.weight, adamw_reason="embedding")
        self.layers = LayerStack(DecoderLayer(cfg, i) for i in _layer_range(cfg, layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if head else None
        if cfg.attn_res:
            self.output_attn_res = DepthMix(cfg.hidden_size, cfg.rms_norm_eps) if head else None

    def forward(self, input_ids_BT: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None,
                cache: InferenceCache | None = None, state_in: ResidualState | None = None, media=None):
        """Without the embedding (a later pipeline stage) the layers start from `state_in`; without the final norm
        (an earlier stage) the ResidualState after the last layer is returned. `media`: a function of the token
        embeddings that puts the vision features in (K3ForConditionalGeneration).

        cu_seqlens (document offsets of a packed row, B = 1) without a cache becomes the per-token document index
        seq_idx [1, T] here, once per forward with static-shape ops, and the layers get seq_idx instead (no host
        read, a document layout of any shape traces as the same graph); T is input_ids' length (a stage called
        without input_ids takes state_in's, which is the whole row unless sequence parallelism shards it). With a
        cache (prefill) the layers get cu_seqlens itself: the per-document final states need the per-document
        layout."""
        if self.embed_tokens is not None:
            h = self.embed_tokens(input_ids_BT)
            if media is not None:
                h = media(h)
            st = ResidualState(blocks=[], partial=h) if self.cfg.attn_res else ResidualState(hidden=h)
        else:
            st = state_in
        seq_idx = None
        if cu_seqlens is not None and cache is None:
            # the whole row's length: under sequence parallelism the state between layers holds a shard of it
            x = input_ids_BT if input_ids_BT is not None else (st.hidden if st.hidden is not None else st.partial)
            if cu_seqlens.dim() != 1 or x.shape[0] != 1:
                raise ValueError(f"cu_seqlens must be 1-D offsets of one packed row (B = 1), got "
                                 f"cu_seqlens {tuple(cu_seqlens.shape)} for B = {x.shape[0]}")
            seq_idx, cu_seqlens = seq_idx_from_cu_seqlens(cu_seqlens, x.shape[1], x.device), None
        for layer in self.layers:
            st = layer(st, cu_seqlens=cu_seqlens,
                       cache_state=cache.layers[layer.layer_idx] if cache is not None else None, seq_idx=seq_idx)
        if self.norm is None:
            return st
        h = self.output_attn_res(st.blocks + [st.partial]) if self.cfg.attn_res else st.hidden
        if cache is not None:
            cache.seen_tokens += input_ids_BT.shape[1]
        return self.norm(h)


class K3ForCausalLM(nn.Module):
    def __init__(self, cfg, init: bool = True, *, layers: range | None = None, embedding: bool = True,
                 head: bool = True):
        """init: draw the initial weights (`reset_parameters`, its seed from torch's default generator); without it
        the parameters are left uninitialised (to be loaded, or built on the meta device and materialised).
        layers / embedding / head: build a part of the model (a pipeline stage): those decoder layers (global
        indices), the token embedding, the output end (output mix, final norm, LM head)."""
        super().__init__()
        self.cfg = cfg
        if cfg.tie_word_embeddings and embedding != head:
            raise ValueError("tied embeddings need the embedding and the LM head in one model part")
        self.model = K3Model(cfg, layers, embedding, head)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if head else None
        if head and cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        elif head:
            annotate(self.lm_head.weight, adamw_reason="lm_head")
        self.loss_fn = CrossEntropy()
        if init:
            self.reset_parameters()

    def init_of(self, module: nn.Module, name: str) -> Init:
        """The initial distribution of `module`'s own parameter `name` (MODEL.md): normal(0, initializer_range) for
        matrices, embeddings and experts, ones for norms, zeros for biases, and the KDA gate/conv init (the AttnRes
        pseudo-queries, zeros, are set by `reset_parameters`)."""
        if isinstance(module, KimiDeltaAttention):
            own = module.init_of(name)
            if own is not None:
                return own
        if isinstance(module, RMSNorm):
            return constant(1.0)
        if name == "bias":
            return constant(0.0)
        return normal(self.cfg.initializer_range)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None):
        """Initialise every parameter this model holds from `seed` (default: drawn from torch's default generator):
        each value a function of (seed, the parameter's global name, the element's global index), so a model part
        or a shard (built on the meta device and materialised, or cut from an initialised model) holds the same
        values as the whole model. Buffers (routing statistics, the router's selection bias) start at zero."""
        if seed is None:
            seed = int(torch.randint(0, 2 ** 62, ()).item())
        depth_queries = {id(m.proj.weight) for m in self.modules() if isinstance(m, DepthMix)}
        owner = {}
        for m in self.modules():
            for pname, p in m.named_parameters(recurse=False):
                owner.setdefault(id(p), (m, pname))
        for name, p in self.named_parameters():
            init = constant(0.0) if id(p) in depth_queries else self.init_of(*owner[id(p)])
            fill_(p, init, seed, name, full_shape(p), shard_offsets(p))
        for b in self.buffers():
            b.zero_()

    def materialize(self, device, dtype: torch.dtype | None = None, seed: int | None = None,
                    init: bool = True) -> "K3ForCausalLM":
        """Allocate a model built on the meta device (and cut or sharded there) on `device`, parameters in `dtype`
        (default: as built; buffers keep theirs), each tensor at the size this model holds, and initialise it
        (`reset_parameters(seed)`); returns self. A parameter keeps its attributes (annotations), gradient hooks
        and ties. init=False leaves the parameters unset (a checkpoint is loaded into them next,
        interop.load_hf_sharded) and zeroes the buffers."""
        new = {}
        for m in self.modules():
            for pname, p in list(m._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                if id(p) not in new:
                    q = nn.Parameter(torch.empty(p.shape, dtype=dtype or p.dtype, device=device),
                                     requires_grad=p.requires_grad)
                    q.__dict__.update(p.__dict__)
                    if p._backward_hooks:
                        q._backward_hooks = p._backward_hooks
                    new[id(p)] = q
                m._parameters[pname] = new[id(p)]
            for bname, b in list(m._buffers.items()):
                if b is not None and b.is_meta:
                    m._buffers[bname] = torch.empty(b.shape, dtype=b.dtype, device=device)
        if init:
            self.reset_parameters(seed)
        else:
            with torch.no_grad():
                for b in self.buffers():
                    b.zero_()
        return self

    def forward(self, input_ids: torch.Tensor | None, labels: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, cache: InferenceCache | None = None,
                return_logits: bool | None = None, state_in: ResidualState | None = None) -> CausalLMOutput:
        """input_ids [B, T]; labels [B, T] aligned with the inputs (label t is the token after t; -100 is
        ignored); cu_seqlens: document offsets of a packed row (B = 1). return_logits: whether the caller wants the
        logits (default: when no labels are given); one device always returns them.

        A pipeline stage without the LM head returns the ResidualState its last layer left (state_in: the previous
        stage's, on a stage without the embedding)."""
        return self._output(self.model(input_ids, cu_seqlens=cu_seqlens, cache=cache, state_in=state_in), labels,
                            cache)

    def _output(self, h, labels, cache) -> CausalLMOutput:
        """The LM head and the loss on the final hidden states (or the ResidualState of a stage without them)."""
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
