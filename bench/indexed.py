"""Benchmark: Megatron indexed datasets. (a) tools/preprocess_data.py throughput on Python standard-library
sources (plain-text documents) with --workers 1 and 2; (b) opening a ~1e6-sequence dataset and random
`ds[i]` reads, ours against megatron-core's IndexedDataset in the same process on the same files.

Usage: python bench/indexed.py [--mb 4] [--vocab 8192] [--reps 3] [--sequences 1000000] [--reads 200000]
Prints markdown tables whose last column is the ratio.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine import machine  # noqa: E402  (bench/machine.py)

from megatron_k3.data.indexed import IndexedDataset, IndexedDatasetWriter  # noqa: E402
from megatron_k3.data.tokenizer import train_bpe  # noqa: E402


def load() -> str:
    return "%.2f" % os.getloadavg()[0]


def stdlib_documents(megabytes: float) -> list:
    """Sorted stdlib .py files that are valid UTF-8, up to about `megabytes` MB in total."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts or "__pycache__" in p.parts:
            continue
        raw = p.read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append(p)
        total += len(raw)
        if total >= megabytes * 1e6:
            break
    return files, total


def bench_preprocess(tmp: Path, mb: float, vocab: int, reps: int) -> list:
    files, nbytes = stdlib_documents(mb)
    tok_path = tmp / "bench.tokenizer.json"
    t0 = time.perf_counter()
    train_bpe((p.read_text() for p in files[: max(1, len(files) // 4)]), vocab, tok_path)
    print(f"trained a {vocab}-token BPE on a quarter of the files in {time.perf_counter() - t0:.1f} s "
          "(not timed below)", file=sys.stderr)
    rows, outputs = [], {}
    for workers in (1, 2):
        tool_s, wall_s = [], []
        cmd = [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", *map(str, files),
               "--output-prefix", str(tmp / f"pp_w{workers}"), "--tokenizer", str(tok_path),
               "--workers", str(workers), "--chunk-docs", "8"]
        for _ in range(reps):
            t0 = time.perf_counter()
            res = subprocess.run(cmd, capture_output=True, text=True)
            wall_s.append(time.perf_counter() - t0)
            if res.returncode:
                raise SystemExit(res.stderr)
            m = re.search(r"(\d+) documents .*?, (\d+) tokens .*?, ([\d.]+) s,", res.stdout)
            docs, tokens = int(m.group(1)), int(m.group(2))
            tool_s.append(float(m.group(3)))
        outputs[workers] = [(tmp / f"pp_w{workers}{ext}").read_bytes() for ext in (".bin", ".idx")]
        rows.append(dict(workers=workers, docs=docs, tokens=tokens, tool_s=statistics.median(tool_s),
                         wall_s=statistics.median(wall_s)))
    assert outputs[1] == outputs[2], "output differs between --workers 1 and 2"
    base = rows[0]["tokens"] / rows[0]["tool_s"]
    print(f"\n(a) tools/preprocess_data.py on {len(files)} stdlib files ({nbytes / 1e6:.1f} MB), BPE vocab {vocab}, "
          f"--chunk-docs 8, median of {reps} runs; outputs byte-identical across --workers\n")
    print("| --workers | documents | tokens | tool s (median) | wall s incl. start-up | tokens/s "
          "| speedup vs 1 worker |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        rate = r["tokens"] / r["tool_s"]
        print(f"| {r['workers']} | {r['docs']} | {r['tokens']:,} | {r['tool_s']:.2f} | {r['wall_s']:.2f} | "
              f"{rate:,.0f} | {rate / base:.2f} |")
    return rows


def write_synthetic(prefix: Path, n_seq: int) -> int:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, n_seq)
    tokens = rng.integers(0, 50000, int(lengths.sum())).astype(np.uint16)
    ends = np.cumsum(lengths).tolist()
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        start = 0
        for e in ends:
            w.add_document(tokens[start:e])
            start = e
    return int(lengths.sum())


def timed_reads(read, order, reps):
    """Mean microseconds per read, best and median over reps."""
    per = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in order:
            read(i)
        per.append((time.perf_counter() - t0) / len(order) * 1e6)
    return min(per), statistics.median(per)


def timed_open(make, reps):
    per = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ds = make()
        per.append(time.perf_counter() - t0)
        del ds
    return min(per) * 1e3, statistics.median(per) * 1e3


def bench_reads(tmp: Path, n_seq: int, n_reads: int, reps: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset
    import logging

    logging.getLogger("megatron").setLevel(logging.WARNING)
    prefix = tmp / "synthetic"
    t0 = time.perf_counter()
    n_tok = write_synthetic(prefix, n_seq)
    print(f"wrote {n_seq:,} sequences, {n_tok:,} uint16 tokens in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    p = str(prefix)
    ours, ours_nv, theirs = IndexedDataset(p), IndexedDataset(p, validate=False), MegatronIndexedDataset(p)
    order = np.random.default_rng(1).integers(0, n_seq, n_reads).tolist()
    for i in order[:1000]:
        assert np.array_equal(ours[i], theirs[i])
    # warm the page cache for all readers alike
    for ds in (ours, theirs):
        for i in order:
            ds[i]
    opens = reps * 3
    rows = [
        ("open (ms)", timed_open(lambda: IndexedDataset(p), opens),
         timed_open(lambda: MegatronIndexedDataset(p), opens)),
        ("open, validate=False (ms)", timed_open(lambda: IndexedDataset(p, validate=False), opens), None),
        ("random ds[i] (us/read)", timed_reads(ours.__getitem__, order, reps),
         timed_reads(theirs.__getitem__, order, reps)),
        ("random ds[i], validate=False (us/read)", timed_reads(ours_nv.__getitem__, order, reps), None),
        ("random get(i, 1) (us/read)", timed_reads(lambda i: ours.get(i, 1), order, reps),
         timed_reads(lambda i: theirs.get(i, 1), order, reps)),
    ]
    print(f"\n(b) {n_seq:,} sequences (lengths 1..64, {n_tok:,} uint16 tokens, "
          f".bin {os.path.getsize(p + '.bin') / 1e6:.0f} MB, .idx {os.path.getsize(p + '.idx') / 1e6:.0f} MB), "
          f"{n_reads:,} random indices, page cache warm; best / median of {reps} reps (opens: {opens})\n")
    print("| measurement | ours best | ours median | megatron-core best | megatron-core median | "
          "ratio (megatron-core / ours, median) |")
    print("|---|---|---|---|---|---|")
    for name, (ob, om), peer in rows:
        if peer is None:
            print(f"| {name} | {ob:.3f} | {om:.3f} | - | - | - |")
        else:
            pb, pm = peer
            print(f"| {name} | {ob:.3f} | {om:.3f} | {pb:.3f} | {pm:.3f} | {pm / om:.2f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=4.0, help="MB of stdlib sources to preprocess")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sequences", type=int, default=1_000_000)
    ap.add_argument("--reads", type=int, default=200_000)
    ap.add_argument("--skip-preprocess", action="store_true")
    args = ap.parse_args()
    print(f"machine: {machine()}; 1-minute load average {load()} at start")
    with tempfile.TemporaryDirectory(prefix="bench_indexed_") as d:
        tmp = Path(d)
        if not args.skip_preprocess:
            bench_preprocess(tmp, args.mb, args.vocab, args.reps)
        bench_reads(tmp, args.sequences, args.reads, args.reps)
    print(f"\n1-minute load average {load()} at the end")


if __name__ == "__main__":
    main()
