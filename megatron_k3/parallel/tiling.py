"""Sequence tiling of the per-token parts (`train.tile_tokens`), applied to a built model from outside: the routed
MoE branch with its dispatch and the shared experts, and the LM head with the loss, run over tiles of at most
`tile_tokens` of the tokens a device holds, each tile checkpointed (its working set is made again, one tile at a time,
in the backward), so their transients scale with the tile instead of the micro-batch (DeepSpeed's tiled MLP and
tiled logits+loss for long sequences). KDA's chunked delta rule, which mixes the tokens, runs over sequence tiles
too (`tiled_kda`): each tile is checkpointed and continues the recurrent state the tile before ended with, so the
chunk terms of one tile are live at a time (on this device's tokens: under context parallelism, inside each of the
rank's chunks).

Exactness: every token's forward is computed by the same operations on the same values, so the loss and the
logits-free forward agree with untiled up to the loss's sum over tiles (fp32 reordering: the mean over the
non-ignored tokens is the count-weighted sum of the tiles' means); the weight gradients are sums over tokens, which
tiles add in another order (fp32 reordering), and the input gradients are row by row the same. tests/test_tiling.py
measures both. With bf16 weights the tiles' weight gradients are summed in bf16 (autograd's input buffer, in the
weights' dtype): within 1.1x untiled's error against fp64 up to 128 tiles, measured there too.

What the tiled forward records is what the untiled one records: the routers' scores reach Quantile Balancing once
per micro-batch, concatenated (not tile by tile), the load counts and dropped assignments are the tiles' sums, and
the balanced dispatch's statistics the tiles' loads summed (replica slots in use: the largest).

Rules (layout.rules, rule 8: the config's layout check names train.tile_tokens, the tokens and the nearest tile sizes
that work, on every rank before anything is built; the planner skips such layouts): a part whose tokens on a device
fit one tile runs untiled; a tiled part's tokens divide into whole tiles (KDA's tiles are the whole chunks of
model.kda_chunk_size covering that many tokens, `kda_tile`, the last one shorter); without sequence parallelism a
MoE tile's rows divide over tp; the drop dispatcher is refused (its per-expert capacity would be per tile, dropping
other assignments than the untiled layer).
"""

from __future__ import annotations

import torch

from ..config.schema import kda_tile
from ..errors import ConfigError
from ..model.k3 import CausalLMOutput
from ..model.kda import KimiDeltaAttention
from ..model.layers import recomputing
from ..model.moe import StableLatentMoE
from ..ops.kda import runs_fused
from ..ops.numerics import compute_dtype
from .recompute import checkpointed_call

__all__ = ["apply", "tiled_kda"]


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
        if n <= tile or not torch.is_grad_enabled():
            return forward(x_BTD)
        if n % tile:  # the config's layout check refuses this first (layout.rules, rule 8)
            raise ConfigError("train.tile_tokens", tile, f"does not divide the {n} tokens a MoE layer gets per "
                              "micro-batch on this device")
        # a recomputed pass records nothing (StableLatentMoE.routed): it leaves the forward's records as they are,
        # whether or not torch's checkpoint stops the recomputation before the end of this function
        first = not recomputing()
        balance, collect = moe.balance, None
        if balance is not None and first and not torch.compiler.is_compiling():
            collect = moe.balance = _Collect()
        outs, loads, dropped, pending, stats = [], 0, 0, [], []
        bal = getattr(moe.dispatcher, "balanced", None)
        try:
            for i in range(n // tile):
                outs.append(checkpointed_call(forward, rows[:, i * tile:(i + 1) * tile]))
                if not first:
                    continue
                loads = loads + moe.tokens_per_expert_E
                dropped = dropped + moe.dropped_assignments
                if moe.pending_observation is not None:  # compiled: the region hands the scores out
                    pending.append(moe.pending_observation)
                    moe.pending_observation = None
                if bal is not None and bal.stats is not None:
                    stats.append(bal.stats)
        finally:
            moe.balance = balance
        if first:
            moe.tokens_per_expert_E, moe.dropped_assignments = loads, dropped
        if pending:
            moe.pending_observation = tuple(torch.cat(parts) for parts in zip(*pending))
        if collect is not None and collect.seen:
            s, b, x = zip(*collect.seen)
            balance.observe(torch.cat(s), b[0], None if x[0] is None else torch.cat(x))
        if stats:
            # the largest on the device (Python's max would read each comparison on the host)
            bal.stats = (sum(st[0] for st in stats), torch.stack([st[1] for st in stats]).amax())
        return torch.cat(outs, 1).view(B, T, -1)
    return run


def _tiled_head(model, tile: int):
    """K3ForCausalLM._output over token tiles: the hidden states enter the LM head's TP region once (the sequence
    all-gather under SP), each tile's logits and loss are made and dropped inside a checkpoint, and the mean over
    the non-ignored tokens is the count-weighted sum of the tiles' means (context parallelism's global mean applied
    once, to the whole, as untiled)."""
    output = model._output

    def run(h, labels, cache):
        if (model.lm_head is None or labels is None or not torch.is_grad_enabled() or cache is not None
                or labels.numel() <= tile):  # the labels: one per token the head gets (SP gathers h to them)
            return output(h, labels, cache)
        n = labels.numel()
        if n % tile:
            raise ConfigError("train.tile_tokens", tile, f"does not divide the {n} tokens the LM head gets per "
                              "micro-batch on this device")
        head = model.lm_head
        tp = getattr(head, "tp", None)
        x = tp.enter(h) if tp is not None and getattr(head, "input_mode", "") == "enter" else h
        x = x.reshape(-1, x.shape[-1])
        y = labels.reshape(-1)
        loss_fn = model.loss_fn
        inner, seq = (loss_fn.inner, loss_fn.seq) if hasattr(loss_fn, "seq") else (loss_fn, None)
        ignore = getattr(inner, "ignore_index", -100)

        def tile_sum(x_t, y_t):
            count = (y_t != ignore).sum()
            mean = inner(head.local_logits(x_t), y_t)
            return torch.where(count > 0, mean * count, torch.zeros_like(mean))

        total = sum(checkpointed_call(tile_sum, x[i * tile:(i + 1) * tile], y[i * tile:(i + 1) * tile])
                    for i in range(n // tile))
        count = (y != ignore).sum()
        if seq is None:
            loss = total / count
        else:  # a share without labels adds nothing, as ContextParallelLoss has it (its 0/0 would be NaN everywhere)
            loss = seq.shard.global_mean(torch.where(count > 0, total / count.clamp_min(1), 0.0), count)
        return CausalLMOutput(logits=None, loss=loss, cache=None)
    return run


def _kda_plain(fn, tile, q, k, v, g, beta, initial_state, output_final_state, seq_idx, state_doc, kw):
    """Rows without documents (or with seq_idx): tile after tile, each continuing the state the one before ended
    with (under seq_idx, in the document of the tile's previous token)."""
    T, outs, S = q.shape[1], [], initial_state
    for s in range(0, T, tile):
        e = min(s + tile, T)
        docs = {} if seq_idx is None else {"seq_idx": seq_idx[:, s:e], "state_doc": None if S is None else
                                           (state_doc if s == 0 else seq_idx[:, s - 1])}
        last = e == T
        o, S = checkpointed_call(fn, q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], initial_state=S,
                                 output_final_state=output_final_state or not last, **docs, **kw)
        outs.append(o)
    return torch.cat(outs, dim=1), S


def _kda_documents(fn, tile, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, kw):
    """One packed row with host offsets: each tile holds the pieces of the documents it cuts; a document cut by a
    tile's start continues from its state at the end of the tile before, the others start from their own initial
    state (or zero); a document's final state is that of its last piece."""
    T, cu = q.shape[1], [int(x) for x in cu_seqlens.tolist()]
    HV, K, V = v.shape[2], k.shape[-1], v.shape[-1]
    zero = q.new_zeros(HV, K, V, dtype=compute_dtype(q, k, v, g, beta, initial_state))
    outs, state = [], {}  # state: document -> its state at the end of its last piece so far

    def start_of(d):
        return initial_state[d] if initial_state is not None else zero

    for s in range(0, T, tile):
        e = min(s + tile, T)
        pieces = [(d, max(a, s), min(b, e)) for d, (a, b) in enumerate(zip(cu[:-1], cu[1:])) if max(a, s) < min(b, e)]
        init = torch.stack([state[d] if a > cu[d] else start_of(d) for d, a, _ in pieces])
        local = torch.tensor([0] + [b - s for _, _, b in pieces], dtype=cu_seqlens.dtype)
        o, finals = checkpointed_call(fn, q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                                      initial_state=init, output_final_state=True, cu_seqlens=local, **kw)
        outs.append(o)
        state.update({d: finals[j] for j, (d, _, _) in enumerate(pieces)})
    final = None
    if output_final_state:
        final = torch.stack([state.get(d, start_of(d)) for d in range(len(cu) - 1)])
    return torch.cat(outs, dim=1), final


def tiled_kda(fn, tile: int):
    """`fn` (ops.kda.chunk_kda's signature) over sequence tiles of `tile` tokens (a multiple of the chunk length),
    each checkpointed: the chunk terms of one tile are live at a time, in the forward and again in the backward, and
    the state crosses tile boundaries as the chunk hand-off does inside one call (the same recurrence, so exact up
    to fp32 reordering: the chunks are the untiled ones, except that a document cut by a tile boundary under
    `cu_seqlens` is chunked again from it). Untiled when the row fits one tile, without gradients, or when fla's
    fused kernel runs (it keeps no chunk terms)."""

    def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
            cu_seqlens=None, *, seq_idx=None, state_doc=None, backend="auto", lower_bound=None):
        kw = {"scale": scale, "chunk_size": chunk_size, "backend": backend, "lower_bound": lower_bound}
        if q.shape[1] <= tile or not torch.is_grad_enabled() or runs_fused(q, chunk_size, backend):
            return fn(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                      cu_seqlens=cu_seqlens, seq_idx=seq_idx, state_doc=state_doc, **kw)
        if cu_seqlens is not None:
            return _kda_documents(fn, tile, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, kw)
        return _kda_plain(fn, tile, q, k, v, g, beta, initial_state, output_final_state, seq_idx, state_doc, kw)
    return run


def apply(model: torch.nn.Module, tile_tokens: int, moe_overflow: str) -> dict:
    """Tile this rank's MoE layers, LM head + loss and KDA delta rules by `tile_tokens` tokens (0: off); returns
    what was tiled."""
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
    kdas = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    for m in kdas:
        m.kernels.chunk_fn = tiled_kda(m.kernels.chunk_fn, kda_tile(tile_tokens, m.chunk_size))
    return {"moe_layers": len(moes), "lm_head": int(head), "kda_layers": len(kdas)}
