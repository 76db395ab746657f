"""Sequence tiling of the per-token parts (`train.tile_tokens`), applied to a built model from outside: the routed
MoE branch with its dispatch and the shared experts, and the LM head with the loss, run over tiles of at most
`tile_tokens` of the tokens a device holds, each tile checkpointed (its working set is made again, one tile at a time,
in the backward), so their transients scale with the tile instead of the micro-batch (DeepSpeed's tiled MLP and
tiled logits+loss for long sequences).

Exactness: every token's forward is computed by the same operations on the same values, so the loss and the
logits-free forward agree with untiled up to the loss's sum over tiles (fp32 reordering: the mean over the
non-ignored tokens is the count-weighted sum of the tiles' means); the weight gradients are sums over tokens, which
tiles add in another order (fp32 reordering), and the input gradients are row by row the same. tests/test_tiling.py
measures both.

What the tiled forward records is what the untiled one records: the routers' scores reach Quantile Balancing once
per micro-batch, concatenated (not tile by tile), the load counts and dropped assignments are the tiles' sums, and
the balanced dispatch's statistics the tiles' loads summed (replica slots in use: the largest).

Rules (ConfigError naming train.tile_tokens, checked when applied, before the first step): the tokens of a
micro-batch on a device divide into tiles of `tile_tokens`; the drop dispatcher is refused (its per-expert capacity
would be per tile, dropping other assignments than the untiled layer).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from ..model.k3 import CausalLMOutput
from ..model.layers import recomputing
from ..model.moe import StableLatentMoE

__all__ = ["apply"]


class _Collect:
    """Stands in for a layer's balancer while its tiles run: keeps each tile's observation."""

    def __init__(self):
        self.seen = []

    def observe(self, scores_NE, bias_E, x_ND=None):
        self.seen.append((scores_NE, bias_E, x_ND))


def _tiled_moe(moe, tile: int):
    forward = moe.forward

    def run(x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        rows = x_BTD.reshape(1, B * T, D)
        n = B * T
        if n % tile:
            raise ConfigError("train.tile_tokens", tile, f"does not divide the {n} tokens a MoE layer gets per "
                              "micro-batch on this device")
        if n == tile or not torch.is_grad_enabled():
            return forward(x_BTD)
        balance, collect = moe.balance, None
        if balance is not None and not recomputing() and not torch.compiler.is_compiling():
            collect = moe.balance = _Collect()
        outs, loads, dropped, pending, stats = [], 0, 0, [], []
        bal = getattr(moe.dispatcher, "balanced", None)
        try:
            for i in range(n // tile):
                outs.append(checkpoint(forward, rows[:, i * tile:(i + 1) * tile], use_reentrant=False))
                loads = loads + moe.tokens_per_expert_E
                dropped = dropped + moe.dropped_assignments
                if moe.pending_observation is not None:  # compiled: the region hands the scores out
                    pending.append(moe.pending_observation)
                    moe.pending_observation = None
                if bal is not None and bal.stats is not None:
                    stats.append(bal.stats)
        finally:
            moe.balance = balance
        moe.tokens_per_expert_E, moe.dropped_assignments = loads, dropped
        if pending:
            moe.pending_observation = tuple(torch.cat(parts) for parts in zip(*pending))
        if collect is not None and collect.seen:
            s, b, x = zip(*collect.seen)
            balance.observe(torch.cat(s), b[0], None if x[0] is None else torch.cat(x))
        if stats:
            bal.stats = (sum(st[0] for st in stats), max(st[1] for st in stats))
        return torch.cat(outs, 1).view(B, T, -1)
    return run


def _tiled_head(model, tile: int):
    """K3ForCausalLM._output over token tiles: the hidden states enter the LM head's TP region once (the sequence
    all-gather under SP), each tile's logits and loss are made and dropped inside a checkpoint, and the mean over
    the non-ignored tokens is the count-weighted sum of the tiles' means (context parallelism's global mean applied
    once, to the whole, as untiled)."""
    output = model._output

    def run(h, labels, cache):
        if model.lm_head is None or labels is None or not torch.is_grad_enabled() or cache is not None:
            return output(h, labels, cache)
        head = model.lm_head
        tp = getattr(head, "tp", None)
        x = tp.enter(h) if tp is not None and getattr(head, "input_mode", "") == "enter" else h
        x = x.reshape(-1, x.shape[-1])
        y = labels.reshape(-1)
        n = x.shape[0]
        if n % tile:
            raise ConfigError("train.tile_tokens", tile, f"does not divide the {n} tokens the LM head gets per "
                              "micro-batch on this device")
        loss_fn = model.loss_fn
        inner, seq = (loss_fn.inner, loss_fn.seq) if hasattr(loss_fn, "seq") else (loss_fn, None)
        ignore = getattr(inner, "ignore_index", -100)

        def tile_sum(x_t, y_t):
            count = (y_t != ignore).sum()
            mean = inner(head.local_logits(x_t), y_t)
            return torch.where(count > 0, mean * count, torch.zeros_like(mean))

        total = sum(checkpoint(tile_sum, x[i * tile:(i + 1) * tile], y[i * tile:(i + 1) * tile], use_reentrant=False)
                    for i in range(n // tile))
        count = (y != ignore).sum()
        loss = total / count
        if seq is not None:
            loss = seq.shard.global_mean(loss, count)
        return CausalLMOutput(logits=None, loss=loss, cache=None)
    return run


def apply(model: torch.nn.Module, tile_tokens: int, moe_overflow: str) -> dict:
    """Tile this rank's MoE layers and LM head + loss by `tile_tokens` tokens (0: off); returns what was tiled."""
    if not tile_tokens:
        return {}
    if moe_overflow == "drop":
        raise ConfigError("train.tile_tokens", tile_tokens, "does not run with model.moe_overflow=drop: its "
                          "per-expert capacity would be per tile and drop other assignments (use dropless, auto or "
                          "balanced)")
    moes = [m for m in model.modules() if isinstance(m, StableLatentMoE)]
    for m in moes:
        m.forward = _tiled_moe(m, tile_tokens)
    head = getattr(model, "lm_head", None) is not None
    if head:
        model._output = _tiled_head(model, tile_tokens)
    return {"moe_layers": len(moes), "lm_head": int(head)}
