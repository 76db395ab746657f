"""Packed language-model samples and their deterministic, resumable order.

A sample is `seq_length + 1` consecutive tokens of a document stream (documents end with the EOD
token), so inputs = sample[:-1] and labels = sample[1:]. Document boundaries inside a sample are
recovered from the EOD token and passed to the model as `cu_seqlens`, so KDA states, short convolutions
and MLA attention restart at each document. Any source that yields such samples (the embedded corpus
here, Megatron .bin/.idx files in the data issue) plugs in through `TokenSampleDataset`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class TokenSampleDataset:
    """Non-overlapping windows of seq_length + 1 tokens (consecutive windows share one boundary token)."""

    def __init__(self, tokens: np.ndarray, seq_length: int, eod_id: int, name: str = "dataset"):
        self.tokens, self.seq_length, self.eod_id, self.name = tokens, seq_length, eod_id, name
        self.num_samples = (len(tokens) - 1) // seq_length
        if self.num_samples < 1:
            raise ValueError(f"{name}: {len(tokens)} tokens cannot serve one sample of seq_length+1="
                             f"{seq_length + 1} tokens (train.seq_length is too large for this data)")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        s = i * self.seq_length
        return np.asarray(self.tokens[s: s + self.seq_length + 1], dtype=np.int64)


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


class GlobalOrder:
    """A seeded global sample order over epochs: sample number c (0-based, counted over the whole run) is
    dataset item perm_{c // n}[c % n]. Each DP rank reads its own slice of every global batch, so resuming
    from `consumed_samples` (under any DP size) continues the same sequence, nothing repeated or skipped."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._cache = {}

    def index(self, c: int) -> int:
        epoch, j = divmod(c, self.n)
        if epoch not in self._cache:
            self._cache = {epoch: epoch_permutation(self.n, self.seed, epoch)}
        return int(self._cache[epoch][j])


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] or [1, B*T] when packed with cu_seqlens
    labels: torch.Tensor
    cu_seqlens: torch.Tensor | None
    num_tokens: int


def make_batch(samples: list, eod_id: int, reset_at_documents: bool) -> Batch:
    """Stack samples; with document resets, flatten the micro-batch into one packed row whose cu_seqlens
    mark both row and document boundaries (a document starts after every EOD input token)."""
    x = torch.from_numpy(np.stack(samples))
    inputs, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    B, T = inputs.shape
    if not reset_at_documents:
        return Batch(inputs, labels, None, B * T)
    flat = inputs.reshape(1, B * T)
    starts = torch.zeros(B * T, dtype=torch.bool)
    starts[::T] = True
    after_eod = torch.zeros(B * T, dtype=torch.bool)
    after_eod[1:] = flat[0, :-1] == eod_id
    starts |= after_eod
    bounds = torch.nonzero(starts).flatten()
    cu = torch.cat([bounds, torch.tensor([B * T])]).to(torch.long)
    return Batch(flat, labels.reshape(1, B * T), cu, B * T)
