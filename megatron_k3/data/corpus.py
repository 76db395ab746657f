"""The embedded default corpus: the Python standard library's source files found on this machine.

No download: tens of MB of real code. A byte-level BPE is trained on it once, the files are tokenized
once (each document ends with the end-of-document token) and both are cached under a key derived from
the file list, so later runs start in seconds. Documents are stored in a fixed shuffled order, so the
contiguous ranges of `data.split` are random samples of the library.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import random
import sysconfig
from pathlib import Path

import numpy as np

from .dataset import ArrayDocuments
from .tokenizer import eod_id, load_tokenizer, train_bpe

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[2]
# <repo>/.cache in a source checkout, else the user's cache directory (an installed package)
DEFAULT_CACHE = (REPO_ROOT / ".cache" if (REPO_ROOT / "pyproject.toml").is_file()
                 else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megatron_k3")


def stdlib_files() -> list:
    """The standard library's .py files, sorted, outside site-packages and __pycache__ (neither is walked: a
    site-packages of an interpreter's own can hold far more files than the library, and every run reads this list)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for where, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "__pycache__")]
        files += [Path(where, n) for n in names if n.endswith(".py")]
    if not files:
        raise FileNotFoundError(f"no Python source files under the standard library at {root}")
    return sorted(files)


def _key(files, vocab_size: int) -> str:
    import tokenizers

    h = hashlib.sha256(f"v1|{vocab_size}|{tokenizers.__version__}".encode())
    for f in files:
        h.update(f"{f}|{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def build_embedded_corpus(cache_dir: str | Path | None, vocab_size: int, progress: bool = True) -> Path:
    """Build (or find) the cached corpus; returns its directory holding tokenizer.json, tokens.npy,
    doc_offsets.npy and meta.json. Builders on one machine (two runs, two test workers) take turns on a lock file:
    one builds while the others wait and then find its result (the tokenizer's training uses every core, so two at
    once take about as long each as one after the other). Where the cache's file system has no locks, builders
    still cannot clash: each writes to a temporary directory of its own and renames it into place."""
    files = stdlib_files()
    base = Path(cache_dir) if cache_dir else DEFAULT_CACHE / "embedded"
    out = base / _key(files, vocab_size)
    if (out / "meta.json").is_file():
        return out
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f".lock-{out.name}", "a") as lock:  # the lock is released when the file closes
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process building the embedded corpus in %s", out)
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:  # a file system without locks
            pass
        if not (out / "meta.json").is_file():
            _build(files, out, vocab_size, progress)
    return out


def _build(files: list, out: Path, vocab_size: int, progress: bool) -> None:
    base = out.parent
    tmp = base / f".tmp-{out.name}-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    order = list(files)
    random.Random(0).shuffle(order)  # fixed document order; the tail is the held-out split
    log.info("building the embedded corpus from %d standard-library files (once; cached in %s)", len(files), out)
    tok = train_bpe((_read(f) for f in order), vocab_size, tmp / "tokenizer.json")
    eod = eod_id(tok)
    from tqdm import tqdm

    pieces, offsets, n = [], [0], 0
    bar = tqdm(total=len(order), desc="tokenizing stdlib", unit="file", disable=not progress)
    for i in range(0, len(order), 64):
        batch = order[i:i + 64]
        for enc in tok.encode_batch([_read(f) for f in batch]):
            ids = np.asarray(enc.ids + [eod], dtype=np.uint16)
            pieces.append(ids)
            n += ids.size
            offsets.append(n)
        bar.update(len(batch))
        bar.set_postfix(tokens=f"{n / 1e6:.1f}M")
    bar.close()
    np.save(tmp / "tokens.npy", np.concatenate(pieces))
    np.save(tmp / "doc_offsets.npy", np.asarray(offsets, dtype=np.int64))
    meta = {"files": len(order), "tokens": n, "vocab_size": tok.get_vocab_size(), "eod_id": eod,
            "bytes": sum(f.stat().st_size for f in order)}
    (tmp / "meta.json").write_text(json.dumps(meta))
    try:
        tmp.rename(out)
    except OSError:  # another process finished first; use theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


class EmbeddedCorpus:
    """The cached corpus as documents (each file's tokens followed by the end-of-document token)."""

    def __init__(self, cache_dir, vocab_size: int, progress: bool = True):
        self.dir = build_embedded_corpus(cache_dir, vocab_size, progress)
        self.meta = json.loads((self.dir / "meta.json").read_text())
        self.documents = ArrayDocuments(np.load(self.dir / "tokens.npy", mmap_mode="r"),
                                        np.load(self.dir / "doc_offsets.npy"), name=f"embedded corpus {self.dir}")
        self.eod_id = int(self.meta["eod_id"])
        self.vocab_size = int(self.meta["vocab_size"])
        self.tokenizer_path = self.dir / "tokenizer.json"

    def tokenizer(self):
        return load_tokenizer(self.tokenizer_path)
