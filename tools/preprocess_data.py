#!/usr/bin/env python
"""Tokenize text files into a Megatron indexed dataset (PREFIX.bin / PREFIX.idx).

    python tools/preprocess_data.py --input FILES... --output-prefix PREFIX
        (--tokenizer tokenizer.json | --train-bpe VOCAB_SIZE)
        [--json-key text] [--text-mode file|lines] [--workers N] [--chunk-docs N]
        [--append-eod | --no-append-eod] [--skip-bad-lines] [--log-interval N]

Inputs ending in .jsonl or .json hold one JSON object per line, the document text under --json-key;
lines without the key or with non-string text are skipped and counted. Any other file is plain text:
one document per file, or one per non-empty line with --text-mode lines. --train-bpe trains a
byte-level BPE on the inputs first and saves it as PREFIX.tokenizer.json.

Documents stream through a pool of --workers processes in chunks of --chunk-docs, with a bounded number
of chunks in flight; output order (and so the output bytes) does not depend on --workers. Each document
becomes one sequence, ending with the end-of-document token unless --no-append-eod; documents with no
tokens are skipped and counted. The output pair appears atomically when the run succeeds.

Exit status: 0 success, 1 bad data (malformed JSON or undecodable text without --skip-bad-lines),
2 bad arguments or missing input files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from pathlib import Path

# --workers is the parallelism knob: each process tokenizes on one thread (set before tokenizers loads).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_k3.data.indexed import IndexedDatasetWriter, best_dtype  # noqa: E402
from megatron_k3.data.tokenizer import eod_id, load_tokenizer, train_bpe  # noqa: E402

PROG = "preprocess_data"
JSON_SUFFIXES = (".jsonl", ".json")
MAX_WARNINGS = 10  # per kind; the rest are only counted


class DataError(Exception):
    """Bad input data (exit status 1); the message names file:line."""


class ArgParser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        print(f"{PROG}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv):
    p = ArgParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", required=True, metavar="FILE", help="input files")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", metavar="PATH", help="a tokenizer.json (Hugging Face tokenizers), or a K3 "
                     "directory (tiktoken.model + tokenizer_config.json: the released tokenizer)")
    tok.add_argument("--train-bpe", type=int, metavar="VOCAB_SIZE",
                     help="train a byte-level BPE of this size on the inputs; saved as PREFIX.tokenizer.json")
    p.add_argument("--json-key", default="text", help="key of the text in each JSON line (default: text)")
    p.add_argument("--text-mode", choices=("file", "lines"), default="file",
                   help="plain-text inputs: one document per file (default) or per non-empty line")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    p.add_argument("--chunk-docs", type=int, default=64, help="documents per task sent to a worker (default: 64)")
    p.add_argument("--append-eod", dest="append_eod", action="store_true", default=True,
                   help="end every document with the end-of-document token (default)")
    p.add_argument("--no-append-eod", dest="append_eod", action="store_false")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip (and count) malformed JSON lines and undecodable files instead of failing")
    p.add_argument("--log-interval", type=int, default=10000,
                   help="documents between progress lines when stderr is not a terminal (default: 10000); "
                        "on a terminal a progress bar shows documents and tokens/s")
    args = p.parse_args(argv)

    for name in ("workers", "chunk_docs", "log_interval"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.train_bpe is not None and args.train_bpe < 257:
        p.error(f"--train-bpe must be >= 257 (256 byte symbols + the end-of-document token), got {args.train_bpe}")
    for f in args.input:
        if not os.path.isfile(f):
            p.error(f"input file not found: {f}" if not os.path.isdir(f) else f"input is a directory, not a file: {f}")
    if args.tokenizer is not None and not os.path.exists(args.tokenizer):
        p.error(f"tokenizer file or directory not found: {args.tokenizer}")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        p.error(f"output directory is not a directory: {out_dir}")
    return args


# --- reading documents (main process, streaming) ------------------------------------------------------

class Counts:
    def __init__(self, warn: bool):
        self.warn = warn
        self.skipped = {}  # kind -> count

    def skip(self, kind: str, where: str, why: str) -> None:
        n = self.skipped[kind] = self.skipped.get(kind, 0) + 1
        if self.warn and n <= MAX_WARNINGS:
            more = " (further ones only counted)" if n == MAX_WARNINGS else ""
            print(f"{PROG}: warning: {where}: {why}; skipped{more}", file=sys.stderr)


def iter_documents(args, counts: Counts):
    """Yield document texts in input order, one file (or one line) in memory at a time."""
    for path in args.input:
        if path.lower().endswith(JSON_SUFFIXES):
            yield from _json_documents(path, args, counts)
        elif args.text_mode == "lines":
            with open(path, "rb") as f:
                for lineno, raw in enumerate(f, 1):
                    text = _decode(raw, f"{path}:{lineno}", args, counts)
                    if text is not None and text.strip():
                        yield text.rstrip("\r\n")
        else:
            with open(path, "rb") as f:
                text = _decode(f.read(), path, args, counts)
            if text is not None:
                yield text


def _decode(raw: bytes, where: str, args, counts: Counts):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if not args.skip_bad_lines:
            raise DataError(f"{where}: not valid UTF-8 ({e}); pass --skip-bad-lines to skip it") from None
        counts.skip("undecodable", where, "not valid UTF-8")
        return None


def _json_documents(path, args, counts: Counts):
    key = args.json_key
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                if not args.skip_bad_lines:
                    raise DataError(f"{path}:{lineno}: malformed JSON ({e}); "
                                    "pass --skip-bad-lines to skip such lines") from None
                counts.skip("malformed", f"{path}:{lineno}", "malformed JSON")
                continue
            if not isinstance(obj, dict) or key not in obj:
                counts.skip("no_key", f"{path}:{lineno}", f"no {key!r} key")
            elif not isinstance(obj[key], str):
                counts.skip("not_text", f"{path}:{lineno}", f"{key!r} is {type(obj[key]).__name__}, not a string")
            else:
                yield obj[key]


def chunks(docs, size: int):
    chunk = []
    for d in docs:
        chunk.append(d)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# --- tokenizing (workers) -----------------------------------------------------------------------------

_TOK = None  # per process: (tokenizer, eod id or None, token dtype)


def _init_worker(tokenizer_path: str, append_eod: bool) -> None:
    global _TOK
    tok = load_tokenizer(tokenizer_path)
    _TOK = (tok, eod_id(tok) if append_eod else None, best_dtype(tok.get_vocab_size()))


def encode_chunk(texts):
    """Token ids of a chunk of documents as (lengths int64[n], all tokens concatenated): compact to
    send back between processes. Empty documents get length 0 (and no end-of-document token)."""
    tok, eod, dtype = _TOK
    ids = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    extra = 0 if eod is None else 1
    lengths = np.array([len(x) + extra if x else 0 for x in ids], np.int64)
    flat = np.empty(int(lengths.sum()), dtype)
    pos = 0
    for x in ids:
        if x:
            flat[pos:pos + len(x)] = x
            pos += len(x)
            if extra:
                flat[pos] = eod
                pos += 1
    return lengths, flat


def ordered_map(fn, items, workers: int, initargs):
    """fn over items in `workers` processes (each set up by _init_worker(*initargs)), results in input
    order, at most 2 * workers items in flight. (Pool.imap would read the whole input iterator ahead
    into its task queue: unbounded memory.) One worker runs in this process."""
    if workers == 1:
        for it in items:
            yield fn(it)
        return
    import multiprocessing as mp

    with mp.get_context().Pool(workers, initializer=_init_worker, initargs=initargs) as pool:
        pending = deque()
        for it in items:
            pending.append(pool.apply_async(fn, (it,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# --- main ---------------------------------------------------------------------------------------------

def run(args) -> int:
    t0 = time.perf_counter()
    prefix = args.output_prefix
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    tokenizer_path = args.tokenizer
    if args.train_bpe is not None:
        tokenizer_path = prefix + ".tokenizer.json"
        print(f"{PROG}: training a byte-level BPE of {args.train_bpe} tokens on the inputs", file=sys.stderr)
        train_bpe(iter_documents(args, Counts(warn=False)), args.train_bpe, Path(tokenizer_path))

    init_args = (tokenizer_path, args.append_eod)
    _init_worker(*init_args)
    tok, _, dtype = _TOK
    counts = Counts(warn=True)
    n_docs = n_tokens = n_empty = 0

    from tqdm import tqdm

    bar = tqdm(desc=PROG, unit=" docs", disable=None, file=sys.stderr, mininterval=0.5)
    t_tok = time.perf_counter()
    next_log = args.log_interval
    with IndexedDatasetWriter(prefix, dtype) as writer:
        results = ordered_map(encode_chunk, chunks(iter_documents(args, counts), args.chunk_docs), args.workers,
                              init_args)
        for lengths, flat in results:
            pos = 0
            for n in lengths.tolist():
                if n == 0:
                    n_empty += 1
                    continue
                writer.add_document(flat[pos:pos + n])
                pos += n
                n_docs += 1
            n_tokens += int(flat.size)
            rate = n_tokens / max(time.perf_counter() - t_tok, 1e-9)
            bar.set_postfix_str(f"{n_tokens:,} tokens, {rate:,.0f} tokens/s", refresh=False)
            bar.update(len(lengths))
            done = n_docs + n_empty
            if bar.disable and done >= next_log:  # no terminal: a plain line every --log-interval documents
                print(f"{PROG}: {done:,} documents, {n_tokens:,} tokens, {rate:,.0f} tokens/s", file=sys.stderr)
                next_log = (done // args.log_interval + 1) * args.log_interval
    bar.close()

    secs = time.perf_counter() - t0
    skipped = "".join(f", {n} skipped ({kind.replace('_', ' ')})" for kind, n in counts.skipped.items())
    outputs = [prefix + ".bin", prefix + ".idx"] + ([tokenizer_path] if args.train_bpe is not None else [])
    print(f"{PROG}: {n_docs} documents ({n_empty} empty skipped{skipped}), {n_tokens} tokens "
          f"({dtype.__name__}, vocab {tok.get_vocab_size()}), {secs:.2f} s, {n_tokens / max(secs, 1e-9):,.0f} "
          f"tokens/s -> {', '.join(outputs)}")
    return 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except DataError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
