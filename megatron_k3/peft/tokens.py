"""Trainable token rows (`peft.trainable_tokens`, PEFT's `trainable_token_indices`): beside the adapters, the rows of
the input embedding and of the LM head for a few token ids train, the rest of both matrices stays frozen.

The case it is for: chat control tokens (and other new special ids) that the base never saw in pre-training. Their
embedding rows are whatever initialisation left, and no adapter downstream can give two such rows distinct meanings
that the frozen rows do not carry; their head rows decide whether the format's tokens can win at all. PEFT's answer
is the same (TrainableTokensLayer).

Each adapted module (the embedding, the LM head; one module when they are tied) holds `token_delta` [n, hidden],
zero at the start, and runs with its weight's rows `ids` replaced by `weight[ids] + token_delta` (an out-of-place
index_add on this rank's block: the base weight is never written, and with a zero delta the outputs equal the base's).
Under tensor parallelism the vocabulary is split; `token_delta` is whole on every rank (n rows are few), each rank
adds the rows of the ids in its block, and the gradient, a partial sum per rank, is summed over TP by a hook.
"""

from __future__ import annotations

import torch
from torch import nn

from ..annotations import annotate, shard_offsets
from ..config.schema import token_ids
from ..errors import ConfigError
from ..parallel.tensor import TensorParallel, mark_partial_grad

__all__ = ["DELTA", "token_ids", "check_tokens", "token_modules", "apply_tokens"]

DELTA = "token_delta"  # the parameter's name in each module (an adapter's: trained, checkpointed)


def check_tokens(spec, vocab_size: int) -> list:
    """`token_ids`, each below the model's vocabulary (ConfigError naming the first that is not)."""
    ids = token_ids(spec)
    if ids and ids[-1] >= vocab_size:
        raise ConfigError("peft.trainable_tokens", ids[-1], f"not a token of this model: model.vocab_size is "
                          f"{vocab_size} (ids 0..{vocab_size - 1})")
    return ids


def token_modules(model: nn.Module) -> list:
    """[(name, module)] of the model's input embedding and LM head, those this part of the model holds."""
    core = getattr(model, "model", None)
    out = []
    if core is not None and getattr(core, "embed_tokens", None) is not None:
        out.append(("model.embed_tokens", core.embed_tokens))
    if getattr(model, "lm_head", None) is not None:
        out.append(("lm_head", model.lm_head))
    return out


class TokenRows:
    """Mixed into an embedding's or LM head's class (the class of the instance is swapped, its weight keeps its
    name): the forward, and the tiled head's per-tile logits (`local_logits`), run with the trained rows in."""

    def _rows_in(self, fn, *args, **kwargs):
        w = self._parameters["weight"]
        if not isinstance(w, nn.Parameter):  # already in (a forward that runs local_logits, or the other way round)
            return fn(*args, **kwargs)
        rows = self.token_delta.index_select(0, self.token_pick).to(w.dtype)
        self._parameters["weight"] = w.index_add(0, self.token_local, rows)
        try:
            return fn(*args, **kwargs)
        finally:
            self._parameters["weight"] = w

    def forward(self, *args, **kwargs):
        return self._rows_in(super().forward, *args, **kwargs)

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._rows_in(super().local_logits, x)


_CLASSES: dict = {}


def _with_rows(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"{cls.__name__}WithTokens", (TokenRows, cls), {"__module__": __name__})
    return _CLASSES[cls]


def _local(module, ids: list) -> tuple:
    """(rows of this rank's block, positions in `ids`) of the ids that fall in the module's weight block."""
    w = module.weight
    start = shard_offsets(w)[0]  # the vocabulary block of a vocabulary-parallel embedding or head
    pick = [i for i, t in enumerate(ids) if start <= t < start + w.shape[0]]
    return torch.tensor([ids[i] - start for i in pick], dtype=torch.long), torch.tensor(pick, dtype=torch.long)


def apply_tokens(model: nn.Module, ids: list, tp: TensorParallel | None = None) -> int:
    """Trainable rows `ids` in the model's embedding and LM head (module docstring); returns the trained elements
    this rank holds. A tied LM head shares the embedding's delta."""
    if not ids:
        return 0
    tp = tp or TensorParallel()
    shared = None
    for name, mod in token_modules(model):
        w = mod.weight
        local, pick = _local(mod, ids)
        mod.register_buffer("token_local", local.to(w.device), persistent=False)
        mod.register_buffer("token_pick", pick.to(w.device), persistent=False)
        tied = shared is not None and shared[0] is w
        delta = shared[1] if tied else nn.Parameter(torch.zeros(len(ids), w.shape[1], dtype=w.dtype, device=w.device))
        if not tied:
            annotate(delta, adamw_reason="embedding" if name.endswith("embed_tokens") else "lm_head")
            if tp.size > 1:
                mark_partial_grad(delta, tp)
            shared = (w, delta)
        mod.token_delta = delta
        mod.__class__ = _with_rows(type(mod))
    return sum({id(m.token_delta): m.token_delta.numel() for _, m in token_modules(model)}.values())
