"""Packed language-model samples with document boundaries, blending, and the deterministic global order.

Legend: T sequence length, N documents, S samples.
A sample is `seq_length + 1` consecutive tokens of an epoch's document stream (the split's documents in a
seeded order per epoch, concatenated), so inputs = sample[:-1] and labels = sample[1:]; consecutive samples
share one boundary token, as in Megatron's GPT dataset. Every sample carries the positions where a new
document starts, which become `cu_seqlens`, so KDA states, short convolutions and MLA attention restart at
each document. Sample number c of the run (counted over all epochs) is a pure function of (seed, c): any
data-parallel layout reads the same global sequence, and a run resumes from `consumed_samples` alone.
Samples of data=multimodal (multimodal.py) also carry their media (pixel_values, grid_thws) and a loss mask;
`make_batch` concatenates the media and turns masked labels into -100.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import parse_split


class ArrayDocuments:
    """Documents stored back to back in one token array, delimited by offsets [N+1]."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, name: str = "documents"):
        self.tokens, self.offsets, self.name = tokens, np.asarray(offsets, dtype=np.int64), name
        self.doc_lengths = np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.doc_lengths)

    def read(self, doc: int, start: int, length: int) -> np.ndarray:
        s = self.offsets[doc] + start
        return np.asarray(self.tokens[s: s + length])


class IndexedDocuments:
    """The documents of a Megatron indexed dataset (a document may span several sequences)."""

    def __init__(self, ds, name: str | None = None):
        self.ds, self.name = ds, name or str(getattr(ds, "path_prefix", "indexed"))
        seq_len = np.asarray(ds.sequence_lengths, dtype=np.int64)
        self.seq_offsets = np.concatenate([[0], np.cumsum(seq_len)])
        di = np.asarray(ds.document_indices, dtype=np.int64)
        self.doc_first_seq = di[:-1]
        self.doc_lengths = self.seq_offsets[di[1:]] - self.seq_offsets[di[:-1]]

    def __len__(self) -> int:
        return len(self.doc_lengths)

    def read(self, doc: int, start: int, length: int) -> np.ndarray:
        """`length` tokens from `start` within document `doc`, across its sequences."""
        first = int(self.doc_first_seq[doc])
        base = self.seq_offsets[first]
        pos, out = base + start, []
        end = pos + length
        seq = int(np.searchsorted(self.seq_offsets, pos, side="right") - 1)
        while pos < end:
            seq_start, seq_end = self.seq_offsets[seq], self.seq_offsets[seq + 1]
            take = min(end, seq_end) - pos
            out.append(np.asarray(self.ds.get(seq, offset=int(pos - seq_start), length=int(take))))
            pos += take
            seq += 1
        return np.concatenate(out) if len(out) > 1 else out[0]


@dataclass
class Sample:
    tokens: np.ndarray  # [T + 1] int64
    doc_starts: np.ndarray  # positions in [0, T] where a document begins (always includes 0)
    # media (data=multimodal; None for text): the sample's media in the order of their placeholder runs
    pixel_values: np.ndarray | None = None  # [P, 3, patch, patch] float32, normalised
    grid_thws: np.ndarray | None = None  # [M, 3] int64: (t, h, w) in patches, one row per medium
    loss_mask: np.ndarray | None = None  # [T] bool, aligned with the labels tokens[1:]: False = label ignored


class PackedDataset:
    """Samples of seq_length + 1 tokens over the documents `doc_ids` of `source`, reshuffled every epoch."""

    reads_files = False  # the tokens are in memory (or a memory map checked at start-up): a read cannot fail

    def __init__(self, source, doc_ids: np.ndarray, seq_length: int, seed: int, name: str = "dataset"):
        self.source, self.seq_length, self.seed, self.name = source, seq_length, seed, name
        self.doc_ids = np.asarray(doc_ids, dtype=np.int64)
        lengths = source.doc_lengths[self.doc_ids]
        self.doc_ids = self.doc_ids[lengths > 0]  # empty documents contribute nothing
        self.tokens_per_epoch = int(source.doc_lengths[self.doc_ids].sum())
        self.samples_per_epoch = max(0, (self.tokens_per_epoch - 1) // seq_length)
        if self.samples_per_epoch < 1:
            raise ValueError(f"{name}: {self.tokens_per_epoch} tokens in {len(self.doc_ids)} documents cannot serve "
                             f"one sample of seq_length+1={seq_length + 1} tokens (train.seq_length is too large "
                             f"for this data)")
        self._epoch = None

    def __len__(self) -> int:
        return self.samples_per_epoch

    def _epoch_tables(self, epoch: int):
        if self._epoch is None or self._epoch[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            docs = rng.permutation(self.doc_ids)
            ends = np.cumsum(self.source.doc_lengths[docs])
            order = rng.permutation(self.samples_per_epoch)
            self._epoch = (epoch, docs, ends, order)
        return self._epoch[1:]

    def sample(self, c: int) -> Sample:
        """Sample number c of the run (0-based, over all epochs)."""
        epoch, j = divmod(int(c), self.samples_per_epoch)
        docs, ends, order = self._epoch_tables(epoch)
        start = int(order[j]) * self.seq_length
        stop = start + self.seq_length + 1
        d = int(np.searchsorted(ends, start, side="right"))
        pieces, starts, pos = [], [], start
        while pos < stop:
            doc_start = int(ends[d - 1]) if d > 0 else 0
            if pos == doc_start:
                starts.append(pos - start)
            take = min(stop, int(ends[d])) - pos
            pieces.append(self.source.read(int(docs[d]), pos - doc_start, take))
            pos += take
            d += 1
        if not starts or starts[0] != 0:
            starts.insert(0, 0)
        return Sample(np.concatenate(pieces).astype(np.int64), np.asarray(starts, dtype=np.int64))


class BlendedDataset:
    """Several datasets mixed by weight: sample c comes from the dataset whose realised share lags its
    weight the most (Megatron's greedy rule), so every prefix of the run matches the weights as closely
    as integers allow. Deterministic; each dataset is read in its own order."""

    def __init__(self, datasets: list, weights: list, name: str = "blend"):
        self.reads_files = any(d.reads_files for d in datasets)
        w = np.asarray(weights, dtype=np.float64)
        if len(datasets) != len(w) or (w <= 0).any():
            raise ValueError(f"{name}: need one positive weight per dataset, got {list(weights)}")
        self.datasets, self.weights, self.name = datasets, w / w.sum(), name
        self._which = np.zeros(0, dtype=np.int64)
        self._index = np.zeros(0, dtype=np.int64)

    def _extend(self, n: int):
        done = len(self._which)
        if n <= done:
            return
        n = max(n, 2 * done, 1024)
        counts = np.bincount(self._which, minlength=len(self.datasets)).astype(np.float64)
        which, index = np.empty(n - done, np.int64), np.empty(n - done, np.int64)
        for i in range(done, n):
            d = int(np.argmax(self.weights * (i + 1) - counts))
            which[i - done], index[i - done] = d, counts[d]
            counts[d] += 1
        self._which = np.concatenate([self._which, which])
        self._index = np.concatenate([self._index, index])

    @property
    def samples_per_epoch(self) -> int:
        return sum(len(d) for d in self.datasets)

    def __len__(self) -> int:
        return self.samples_per_epoch

    def source_of(self, c: int) -> tuple:
        self._extend(c + 1)
        return int(self._which[c]), int(self._index[c])

    def sample(self, c: int) -> Sample:
        d, i = self.source_of(c)
        return self.datasets[d].sample(i)


def split_documents(num_docs: int, split: str) -> dict:
    """Megatron-style 'train,valid,test' proportions over contiguous document ranges."""
    parts = parse_split(split)
    bounds = np.round(np.cumsum([0.0] + parts) * num_docs).astype(np.int64)
    return {k: np.arange(bounds[i], bounds[i + 1]) for i, k in enumerate(("train", "valid", "test"))}


def rank_sample_ids(consumed: int, micro: int, rank: int, dp: int, micro_batch_size: int) -> list:
    """Global sample numbers that data-parallel `rank` reads for micro-batch `micro` of the global batch
    starting at `consumed`: each global batch is the next contiguous block of the global order."""
    base = consumed + (micro * dp + rank) * micro_batch_size
    return list(range(base, base + micro_batch_size))


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T], or [1, B*T] when packed with cu_seqlens
    labels: torch.Tensor  # -100 where a sample's loss_mask is False (media, padding)
    cu_seqlens: torch.Tensor | None
    num_tokens: int
    pixel_values: torch.Tensor | None = None  # [P, 3, patch, patch] float32: every sample's media, in sample order
    grid_thws: torch.Tensor | None = None  # [M, 3] int64; None (both) when no sample carries media


def make_batch(samples: list, reset_at_documents: bool) -> Batch:
    """Stack samples; with document resets, flatten the micro-batch into one packed row whose cu_seqlens
    mark both row and document boundaries (a boundary at position T of a sample belongs to its labels
    only and is dropped). Media are concatenated in sample order, which is the order of their placeholder runs
    in the rows; labels are -100 where a sample's loss_mask is False."""
    x = torch.from_numpy(np.stack([s.tokens for s in samples]))
    inputs, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    B, T = inputs.shape
    if any(s.loss_mask is not None for s in samples):
        keep = np.stack([np.ones(T, dtype=bool) if s.loss_mask is None else np.asarray(s.loss_mask, dtype=bool)
                         for s in samples])
        labels = labels.masked_fill(torch.from_numpy(~keep), -100)
    media = [s for s in samples if s.pixel_values is not None]
    pixels = grids = None
    if media:
        pixels = torch.from_numpy(np.concatenate([s.pixel_values for s in media]).astype(np.float32, copy=False))
        grids = torch.from_numpy(np.concatenate([np.asarray(s.grid_thws, dtype=np.int64).reshape(-1, 3)
                                                 for s in media]))
    if not reset_at_documents:
        return Batch(inputs, labels, None, B * T, pixels, grids)
    starts = sorted({r * T + int(p) for r, s in enumerate(samples) for p in s.doc_starts if p < T}
                    | {r * T for r in range(B)})
    cu = torch.tensor(starts + [B * T], dtype=torch.long)
    return Batch(inputs.reshape(1, B * T), labels.reshape(1, B * T), cu, B * T, pixels, grids)
