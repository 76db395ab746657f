"""Packed samples with document boundaries, blending, splits and the DP-independent global order."""

import numpy as np
import pytest
import torch

from megatron_k3.config import load_model_config
from megatron_k3.data.dataset import (ArrayDocuments, BlendedDataset, PackedDataset, make_batch, rank_sample_ids,
                                      split_documents)
from megatron_k3.model import K3ForCausalLM


def random_documents(n=40, seed=0, max_len=50, vocab=1000):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len, size=n)  # includes empty documents
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return ArrayDocuments(rng.integers(1, vocab, size=offsets[-1]), offsets), lengths


def test_samples_are_windows_of_the_shuffled_epoch_stream():
    docs, lengths = random_documents()
    ids = np.arange(len(lengths))
    T = 16
    ds = PackedDataset(docs, ids, T, seed=3)
    for epoch in range(2):
        order = np.random.default_rng([3, epoch]).permutation(ids[lengths > 0])
        stream = np.concatenate([docs.read(d, 0, lengths[d]) for d in order])
        starts = set(np.cumsum([0] + [lengths[d] for d in order])[:-1].tolist())
        seen = set()
        for j in range(ds.samples_per_epoch):
            s = ds.sample(epoch * ds.samples_per_epoch + j)
            # find which window it is: samples are a permutation of the windows
            w = next(w for w in range(ds.samples_per_epoch)
                     if w not in seen and np.array_equal(stream[w * T: w * T + T + 1], s.tokens))
            seen.add(w)
            expect = sorted({0} | {p - w * T for p in starts if w * T <= p <= w * T + T})
            assert s.doc_starts.tolist() == expect
        assert seen == set(range(ds.samples_per_epoch))


def test_too_long_sequence_is_a_clear_error():
    docs, lengths = random_documents(n=3, max_len=5)
    with pytest.raises(ValueError, match="seq_length"):
        PackedDataset(docs, np.arange(3), 10_000, seed=0, name="tiny")


def test_packed_row_gives_each_document_its_own_logits():
    """A sample holding several documents, batched with cu_seqlens, equals running each piece alone
    (KDA state, short conv and MLA attention all restart at the boundary)."""
    cfg = load_model_config("k3_tiny")
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).eval()
    rng = np.random.default_rng(1)
    lengths = np.array([70, 30, 45, 90])
    docs = ArrayDocuments(rng.integers(0, cfg.vocab_size, size=lengths.sum()), np.concatenate([[0], np.cumsum(lengths)]))
    ds = PackedDataset(docs, np.arange(4), 96, seed=0)
    samples = [ds.sample(c) for c in range(2)]
    assert any(len(s.doc_starts) > 1 for s in samples)
    b = make_batch(samples, reset_at_documents=True)
    with torch.no_grad():
        packed = model(b.input_ids, cu_seqlens=b.cu_seqlens).logits[0]
        cu = b.cu_seqlens.tolist()
        pieces = [model(b.input_ids[:, a:e]).logits[0] for a, e in zip(cu[:-1], cu[1:])]
    ref = torch.cat(pieces)
    assert ((packed - ref).abs().max() / ref.abs().max()).item() < 1e-4
    assert len(cu) - 1 >= 3  # row boundary plus at least one document boundary


def test_blend_follows_weights_in_every_prefix():
    docs, _ = random_documents(n=60, seed=2)
    a = PackedDataset(docs, np.arange(0, 30), 8, seed=1, name="a")
    b = PackedDataset(docs, np.arange(30, 60), 8, seed=1, name="b")
    blend = BlendedDataset([a, b], [0.7, 0.3])
    which = np.array([blend.source_of(c)[0] for c in range(1000)])
    counts = np.cumsum(np.stack([which == 0, which == 1], 1), 0)
    n = np.arange(1, 1001)[:, None]
    assert np.abs(counts - n * np.array([0.7, 0.3])).max() <= 1.0
    again = BlendedDataset([a, b], [7, 3])
    assert all(again.source_of(c) == blend.source_of(c) for c in range(0, 1000, 37))
    # each dataset is read in its own order, without gaps
    idx_a = [blend.source_of(c)[1] for c in range(1000) if which[c] == 0]
    assert idx_a == list(range(len(idx_a)))


def test_split_documents_is_contiguous_and_complete():
    s = split_documents(1000, "969,30,1")
    assert len(s["train"]) == 969 and len(s["valid"]) == 30 and len(s["test"]) == 1
    assert np.array_equal(np.concatenate([s["train"], s["valid"], s["test"]]), np.arange(1000))
    with pytest.raises(ValueError):
        split_documents(10, "a,b")


@pytest.mark.parametrize("dp_before,dp_after", [(2, 1), (1, 2), (4, 2)])
def test_global_order_is_independent_of_data_parallel_size(dp_before, dp_after):
    """Each global batch is the next contiguous block of the global sample order, however it is split
    over ranks, so resuming under another DP size neither repeats nor skips a sample."""
    gbs, mbs = 8, 2

    def run(dp, consumed, steps):
        seen = []
        for _ in range(steps):
            batch = []
            for micro in range(gbs // (mbs * dp)):
                for rank in range(dp):
                    batch += rank_sample_ids(consumed, micro, rank, dp, mbs)
            assert sorted(batch) == list(range(consumed, consumed + gbs))
            seen += sorted(batch)
            consumed += gbs
        return seen, consumed

    straight, _ = run(dp_before, 0, 6)
    first, consumed = run(dp_before, 0, 3)
    second, _ = run(dp_after, consumed, 3)
    assert first + second == straight == list(range(6 * gbs))
