"""Megatron indexed datasets: byte-for-byte interchange with megatron-core, random access, clear errors on
bad files, and tools/preprocess_data.py end to end."""

import json
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_k3.data import indexed
from megatron_k3.data.indexed import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter, best_dtype
from megatron_k3.data.tokenizer import EOD_TOKEN, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
HEADER = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document-offset count 8


@pytest.fixture(scope="module")
def mc():
    """megatron-core's indexed_dataset module (its package import warns about missing TE/apex on CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def random_documents(seed, n_docs, high, max_seqs=3, max_len=40):
    """A list of documents, each a list of 1..max_seqs sequences (some empty) of ids in [0, high)."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, high, int(rng.integers(0, max_len))).astype(np.int64)
             for _ in range(int(rng.integers(1, max_seqs + 1)))] for _ in range(n_docs)]


def write_ours(prefix, docs, dtype):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in docs:
            if len(doc) == 1:
                w.add_document(doc[0])
            else:
                for seq in doc:
                    w.add_item(seq)
                w.end_document()
    return prefix


def write_megatron(mc, prefix, docs, dtype, modes=None):
    builder = mc.IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype, multimodal=modes is not None)
    k = 0
    for doc in docs:
        for seq in doc:
            if modes is None:
                builder.add_item(torch.from_numpy(seq))
            else:
                builder.add_item(torch.from_numpy(seq), mode=modes[k])
            k += 1
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return prefix


def expected_layout(docs):
    seqs = [s for doc in docs for s in doc]
    doc_idx = np.cumsum([0] + [len(doc) for doc in docs])
    return seqs, doc_idx


@pytest.fixture(params=[None, 2], ids=["chunk=default", "chunk=2"])
def chunk(request, monkeypatch):
    """Also run with index arrays scanned / written in chunks of 2 entries, to cover the chunk seams."""
    if request.param is not None:
        monkeypatch.setattr(indexed, "_CHUNK", request.param)
    return request.param


@pytest.mark.parametrize("dtype,high", [(np.uint16, 65535), (np.int32, 2**31 - 1)])
def test_megatron_interchange(tmp_path, mc, dtype, high, chunk):
    docs = random_documents(0, 60, high)
    seqs, doc_idx = expected_layout(docs)
    ours = write_ours(str(tmp_path / "ours"), docs, dtype)
    theirs = write_megatron(mc, str(tmp_path / "theirs"), docs, dtype)

    for ext in (".bin", ".idx"):
        assert Path(ours + ext).read_bytes() == Path(theirs + ext).read_bytes(), ext

    # ours written -> megatron-core reads
    m = mc.IndexedDataset(ours)
    assert len(m) == len(seqs)
    np.testing.assert_array_equal(m.document_indices, doc_idx)
    np.testing.assert_array_equal(m.sequence_lengths, [len(s) for s in seqs])
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(m[i], s)

    # megatron-core written -> ours reads
    ds = IndexedDataset(theirs, expected_dtype=dtype)
    assert len(ds) == len(seqs) and ds.dtype == dtype and ds.num_documents == len(docs)
    assert ds.num_tokens == sum(len(s) for s in seqs)
    np.testing.assert_array_equal(ds.document_indices, doc_idx)
    np.testing.assert_array_equal(ds.sequence_lengths, m.sequence_lengths)
    np.testing.assert_array_equal(ds.sequence_pointers, m.index.sequence_pointers)
    assert ds.sequence_modes is None
    for i, s in enumerate(seqs):
        assert ds[i].dtype == dtype
        np.testing.assert_array_equal(ds[i], s)


def test_reads_megatron_sequence_modes(tmp_path, mc):
    docs = random_documents(1, 20, 1000)
    seqs, doc_idx = expected_layout(docs)
    modes = np.random.default_rng(1).integers(0, 3, len(seqs)).tolist()
    prefix = write_megatron(mc, str(tmp_path / "mm"), docs, np.uint16, modes=modes)
    ds = IndexedDataset(prefix)
    np.testing.assert_array_equal(ds.sequence_modes, modes)
    np.testing.assert_array_equal(ds.document_indices, doc_idx)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], s)


@pytest.mark.parametrize("validate", [True, False])  # aligned fast path / byte-offset path
def test_random_access(tmp_path, validate, chunk):
    docs = random_documents(2, 1500, 50000, max_len=100)
    seqs, _ = expected_layout(docs)
    ds = IndexedDataset(write_ours(str(tmp_path / "r"), docs, np.uint16), validate=validate)
    rng = np.random.default_rng(3)
    for i in rng.integers(-len(seqs), len(seqs), 3000).tolist():
        np.testing.assert_array_equal(ds[i], seqs[i])
        n = len(seqs[i])
        off = int(rng.integers(0, n + 1))
        length = int(rng.integers(0, n - off + 1))
        np.testing.assert_array_equal(ds.get(i, off, length), seqs[i][off:off + length])
        np.testing.assert_array_equal(ds.get(i, off), seqs[i][off:])
    for sl in (slice(5, 17), slice(-9, None), slice(3, 40, 7)):
        got, want = ds[sl], seqs[sl]
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    with pytest.raises(IndexError):
        ds[len(seqs)]
    with pytest.raises(IndexError):
        ds.get(0, 0, len(seqs[0]) + 1)
    k = next(i for i, s in enumerate(seqs) if len(s))
    with pytest.raises(ValueError):  # returned arrays are read-only views of the file
        ds[k][0] = 1


def test_empty_dataset(tmp_path):
    with IndexedDatasetWriter(tmp_path / "e", np.uint16):
        pass
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0
    np.testing.assert_array_equal(ds.document_indices, [0])


def test_writer_rejects_and_cleans_up(tmp_path):
    prefix = tmp_path / "w"
    with pytest.raises(ValueError, match=r"token id 70000 does not fit uint16"):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_document([1, 2, 3])
            assert not (tmp_path / "w.bin").exists()  # nothing visible before finalize
            w.add_document(np.array([5, 70000], dtype=np.int64))
    with pytest.raises(ValueError, match=r"token id -1 does not fit uint16"):
        IndexedDatasetWriter(prefix, np.uint16).add_document([-1])
    with pytest.raises(ValueError, match=r"token id 2147483648 does not fit int32"):
        IndexedDatasetWriter(prefix, np.int32).add_document(np.array([2**31]))
    with pytest.raises(ValueError, match="integers"):
        IndexedDatasetWriter(prefix).add_document(np.array([1.5]))
    with pytest.raises(ValueError, match="end_document"):
        with IndexedDatasetWriter(prefix) as w:
            w.add_item([1])
    with pytest.raises(ValueError, match="float32"):
        IndexedDatasetWriter(prefix, np.float32)
    assert sorted(p.name for p in tmp_path.iterdir() if "w" in p.name) == []  # temporaries removed


def test_best_dtype():
    assert best_dtype(300) == np.uint16 and best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32 and best_dtype(None) == np.int32


# --- bad files -------------------------------------------------------------------------------------

def _patch(path, offset, data):
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def _truncate(path, n):
    path.write_bytes(path.read_bytes()[:-n])


N_SEQ = 4  # sequences of the dataset below: lengths 3, 2, 4, 1; one document each. With chunk=2, pointer 2
# and document offset 2 (corrupted below) start a chunk, so the checks across chunk seams are covered.


def _corrupt_pointer(idx):  # pointer 2 below pointer 1
    _patch(idx, HEADER + 4 * N_SEQ + 8 * 2, struct.pack("<q", 2))


BAD_CASES = {  # name: (file the error names, corruption, kwargs, message fragment)
    "missing bin": ("bin", lambda idx, bin_: bin_.unlink(), {}, "not found"),
    "missing idx": ("idx", lambda idx, bin_: idx.unlink(), {}, "not found"),
    "wrong magic": ("idx", lambda idx, bin_: _patch(idx, 0, b"MMIDIDY"), {}, "bad magic"),
    "short header": ("idx", lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:20]), {}, "truncated header"),
    "version": ("idx", lambda idx, bin_: _patch(idx, 9, struct.pack("<Q", 2)), {}, "unsupported version 2"),
    "dtype code": ("idx", lambda idx, bin_: _patch(idx, 17, bytes([42])), {}, "unknown dtype code 42"),
    "truncated idx": ("idx", lambda idx, bin_: _truncate(idx, 8), {}, "truncated"),
    "truncated bin": ("bin", lambda idx, bin_: _truncate(bin_, 2), {}, "truncated or corrupted"),
    "dtype mismatch": ("idx", lambda idx, bin_: None, {"expected_dtype": np.int32}, "int32 was expected"),
    "pointers": ("idx", lambda idx, bin_: _corrupt_pointer(idx), {}, "not monotone"),
    "negative length": ("idx", lambda idx, bin_: _patch(idx, HEADER + 4, struct.pack("<i", -2)), {},
                        "negative length"),
    "document indices end": ("idx", lambda idx, bin_: _patch(idx, HEADER + 12 * N_SEQ + 8 * N_SEQ,
                                                             struct.pack("<q", 3)), {}, "document indices"),
    "document indices": ("idx", lambda idx, bin_: _patch(idx, HEADER + 12 * N_SEQ + 8 * 2, struct.pack("<q", 0)),
                         {}, "document indices are not monotone"),
    "trailing bytes": ("idx", lambda idx, bin_: idx.write_bytes(idx.read_bytes() + b"\0"), {}, "unexpected bytes"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_files_raise_naming_the_file(tmp_path, case, chunk):
    which, corrupt, kwargs, fragment = BAD_CASES[case]
    prefix = tmp_path / "bad"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for n in (3, 2, 4, 1):
            w.add_document(np.arange(n) + 7)
    IndexedDataset(prefix)  # the unmodified pair is fine
    idx, bin_ = tmp_path / "bad.idx", tmp_path / "bad.bin"
    corrupt(idx, bin_)
    with pytest.raises(IndexedDatasetError) as err:
        IndexedDataset(prefix, **kwargs)
    msg = str(err.value)
    assert msg.startswith(str(idx if which == "idx" else bin_)), msg
    assert fragment in msg, msg


# --- tools/preprocess_data.py ----------------------------------------------------------------------

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Ünïcödé: 漢字 and emoji 🙂 survive\nnewlines too.",
         "", "def f(x):\n    return x * 2\n", "short", "tabs\tand  double  spaces  "]


def preprocess(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_preprocess_data_end_to_end(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": t}) for t in TEXTS] + [json.dumps({"title": "no text"}), json.dumps({"text": 3})]
    jsonl.write_text("\n".join(lines * 5) + "\n")
    txt = tmp_path / "notes.txt"
    txt.write_text("A plain text file is one document.\nIts lines stay together.\n")
    inputs = ["--input", jsonl, txt]

    r = preprocess(*inputs, "--output-prefix", tmp_path / "a", "--train-bpe", 300)
    assert r.returncode == 0, r.stderr
    assert "documents" in r.stdout and "tokens/s" in r.stdout
    tok_path = tmp_path / "a.tokenizer.json"
    outs = {}
    for name, workers in (("b", 1), ("c", 2)):
        r = preprocess(*inputs, "--output-prefix", tmp_path / name, "--tokenizer", tok_path,
                       "--workers", workers, "--chunk-docs", 3)
        assert r.returncode == 0, r.stderr
        outs[name] = [(tmp_path / f"{name}{ext}").read_bytes() for ext in (".bin", ".idx")]
    assert outs["b"] == outs["c"]  # independent of --workers (and of --chunk-docs)
    assert outs["b"] == [(tmp_path / f"a{ext}").read_bytes() for ext in (".bin", ".idx")]

    tok = load_tokenizer(tok_path)
    eod = tok.token_to_id(EOD_TOKEN)
    want = [t for t in TEXTS if t] * 5 + [txt.read_text()]  # empty documents skipped
    ds = IndexedDataset(tmp_path / "c", expected_dtype=np.uint16)
    assert len(ds) == ds.num_documents == len(want)
    for i, text in enumerate(want):
        ids = ds[i].tolist()
        assert ids[-1] == eod and eod not in ids[:-1]
        assert tok.decode(ids[:-1]) == text

    r = preprocess(*inputs, "--output-prefix", tmp_path / "d", "--tokenizer", tok_path, "--no-append-eod",
                   "--text-mode", "lines")
    assert r.returncode == 0, r.stderr
    ds = IndexedDataset(tmp_path / "d")
    assert len(ds) == len(want) + 1  # the text file's two lines are two documents
    assert tok.decode(ds[-1].tolist()) == "Its lines stay together."
    assert eod not in np.concatenate(list(ds)).tolist()

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    r = preprocess("--input", bad, "--output-prefix", tmp_path / "e", "--tokenizer", tok_path, "--workers", 2)
    assert r.returncode != 0 and f"{bad}:2" in r.stderr, r.stderr
    assert not (tmp_path / "e.bin").exists() and not list(tmp_path.glob(".e.*"))  # nothing left behind
    r = preprocess("--input", bad, "--output-prefix", tmp_path / "e", "--tokenizer", tok_path, "--skip-bad-lines")
    assert r.returncode == 0 and len(IndexedDataset(tmp_path / "e")) == 1, r.stderr


def test_preprocess_data_bad_arguments(tmp_path):
    r = preprocess("--input", tmp_path / "missing.txt", "--output-prefix", tmp_path / "x", "--train-bpe", 300)
    assert r.returncode == 2 and "missing.txt" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    (tmp_path / "t.txt").write_text("x")
    r = preprocess("--input", tmp_path / "t.txt", "--output-prefix", tmp_path / "x")
    assert r.returncode == 2 and "--tokenizer" in r.stderr
