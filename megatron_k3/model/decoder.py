"""One decoder layer (mixer + FFN) and the Block Attention Residual bookkeeping between layers.

Legend: B batch, T tokens, D hidden.
With AttnRes there is no ordinary residual stream: the state between layers is (blocks, partial),
where `blocks` are the completed block representations (b_0 = the embedding) and `partial` is the
running sum of the current block's sub-layer outputs. A layer mixes them over depth before its mixer
and before its FFN with its own zero-initialised pseudo-queries (uniform weights at init).
Without AttnRes (Kimi Linear) the layer is the usual pre-norm residual block.
Packed documents reach the mixer as `cu_seqlens` (N+1 offsets of one row, read on the host: prefill with a decode
cache) or as `seq_idx` [B, T] int64 (the document index of each token, non-decreasing along T; static shapes, no
host read: what K3Model passes for training and plain forwards, so that a layer traces without graph breaks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..annotations import annotate
from ..ops.attn_res import attn_res
from .kda import KimiDeltaAttention
from .layers import Linear, recomputing
from .mla import GatedMLA
from .mlp import GatedMLP
from .moe import StableLatentMoE
from .norm import RMSNorm


@dataclass
class ResidualState:
    """What flows between decoder layers."""
    hidden: torch.Tensor | None = None  # ordinary residual stream (attn_res off)
    blocks: list = field(default_factory=list)  # completed AttnRes blocks (attn_res on)
    partial: torch.Tensor | None = None  # running sum of the current block


class DepthMix(nn.Module):
    """A pseudo-query ([1, D] Linear weight, zero init) and its key-norm weight (RMSNorm weight, ones).

    `last_weights_N` holds the depth weights of the last forward averaged over this rank's tokens (detached,
    on device, no host sync), for the training metrics: one weight per source, the completed blocks first
    (b_0 = the embedding) and the running partial sum last."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.proj = Linear(dim, 1, bias=False)
        annotate(self.proj.weight, adamw_reason="attn_res_query")
        self.norm = RMSNorm(dim, eps)
        self.last_weights_N: torch.Tensor | None = None

    def forward(self, sources):
        h, alpha_N = self.mix(sources)
        if not recomputing():
            self.last_weights_N = alpha_N.detach().flatten(1).mean(1)
        return h

    def mix(self, sources):
        """The depth mix of `sources` and its weights (what selective recomputation's `attn_res` rebuilds; the
        forward records the weights)."""
        return attn_res(sources, self.proj.weight[0], self.norm.weight, self.norm.eps, return_weights=True)


class LayerStack(nn.ModuleDict):
    """Decoder layers under their global indices (`layers.{i}` in the state dict), iterated in order like an
    nn.ModuleList; `stack[i]` is global layer i. A model part (a pipeline stage) holds a contiguous range of them."""

    def __init__(self, layers=None):
        super().__init__({str(layer.layer_idx): layer for layer in (layers or ())})

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, i):
        return super().__getitem__(str(i))

    def indices(self) -> list:
        return [int(k) for k in self.keys()]


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.mixer_type = cfg.layer_types()[layer_idx]
        self.ffn_type = cfg.ffn_types()[layer_idx]
        self.self_attn = GatedMLA(cfg, layer_idx) if self.mixer_type == "mla" else KimiDeltaAttention(cfg, layer_idx)
        if self.ffn_type == "moe":
            self.mlp = StableLatentMoE(cfg)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size, cfg.hidden_act,
                                cfg.situ_beta_gate, cfg.situ_beta_up)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_res = cfg.attn_res
        self.block_size = cfg.attn_res_block_size
        if self.attn_res:
            # names follow the K3 checkpoint: self_attention_res_{proj,norm}, mlp_res_{proj,norm}
            self.self_attention_res = DepthMix(cfg.hidden_size, cfg.rms_norm_eps)
            self.mlp_res = DepthMix(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, st: ResidualState, cu_seqlens=None, cache_state=None, seq_idx=None) -> ResidualState:
        """One layer on the state between layers; cu_seqlens / seq_idx: the packed documents (at most one)."""
        if not self.attn_res:
            h = st.hidden
            h = h + self.self_attn(self.input_layernorm(h), cu_seqlens=cu_seqlens, state=cache_state,
                                   seq_idx=seq_idx)
            h = h + self.mlp(self.post_attention_layernorm(h))
            return ResidualState(hidden=h)
        blocks, p = list(st.blocks), st.partial
        x_attn = p if not blocks else self.self_attention_res(blocks + [p])
        if self.layer_idx % self.block_size == 0:  # the finished block (or the embedding) is frozen
            blocks.append(p)
            p = None
        a = self.self_attn(self.input_layernorm(x_attn), cu_seqlens=cu_seqlens, state=cache_state, seq_idx=seq_idx)
        p = a if p is None else p + a
        x_mlp = self.mlp_res(blocks + [p])
        p = p + self.mlp(self.post_attention_layernorm(x_mlp))
        return ResidualState(blocks=blocks, partial=p)
