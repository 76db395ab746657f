#!/usr/bin/env python
"""Print the token ids a run's training data uses, as a `peft.trainable_tokens` value.

    python tools/token_ids.py data=chat [data.paths=[...] data.tokenizer=... ...] [--min-count N] [--json]

The run is composed as `python -m megatron_k3.train` composes it (the same overrides, `model=from_checkpoint
checkpoint.load=DIR` included), its training split is built as the trainer builds it, and one epoch of samples is
read: every id of the samples' documents is counted (the padding after a sample's last conversation is not). The
output is one line of ids and inclusive ranges, `first-last`, ready for `'peft.trainable_tokens=[...]'` (docs/peft.md,
"Trainable token rows"); `--min-count N` keeps the ids seen at least N times; `--json` prints {"ids", "count",
"tokens", "spec"} instead.

What it is for: a base that never learned the rows of the tokens your fine-tuning data is made of. The tiny K3 of
`make train` saw 0.4M tokens of pre-training, fewer than the embedded chat set holds, so its rows for most of the chat
set's 828 ids are barely trained, and adapters downstream of a frozen row cannot make up for it (docs/sft.md measures
it). `make sft PEFT=lora` trains those rows. A released model's rows are trained: over K3 you need this only for ids
you add, and for K3's 163840-id vocabulary a chat corpus uses most rows, which is the full embedding again.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_k3.config import ConfigError, compose_run_config  # noqa: E402
from megatron_k3.data.build import build_data  # noqa: E402
from megatron_k3.interop import checkpoint_model_config  # noqa: E402


def ranges(ids) -> str:
    """Sorted distinct ids as `a,b-c,...` (the form peft.trainable_tokens parses)."""
    ids = sorted(int(i) for i in ids)
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def _data_tokens(ds, c: int, sample) -> np.ndarray:
    """Sample c's tokens without its padding: where the dataset packs whole conversations (data=chat, multimodal;
    `documents_of`), the tail after the last one is padding, which no learned position reads."""
    if hasattr(ds, "source_of"):  # a blend: the sample's own dataset knows its documents
        d, i = ds.source_of(c)
        return _data_tokens(ds.datasets[d], i, sample)
    if not hasattr(ds, "documents_of"):
        return sample.tokens
    starts = list(sample.doc_starts) + [len(sample.tokens)]
    return sample.tokens[:starts[len(ds.documents_of(c))]]


def data_counts(overrides: list) -> tuple:
    """(counts per id [vocab], tokens read) over one epoch of the composed run's training split."""
    run, _, _ = compose_run_config(overrides, model_reader=checkpoint_model_config)
    train, _ = build_data(run, 0)
    counts = np.zeros(run.model.vocab_size, dtype=np.int64)
    total = 0
    for c in range(len(train)):
        tokens = np.asarray(_data_tokens(train, c, train.sample(c)), dtype=np.int64)
        if tokens.size and tokens.max() >= len(counts):
            raise ValueError(f"training sample {c} holds id {int(tokens.max())}, past model.vocab_size={len(counts)}")
        counts += np.bincount(tokens, minlength=len(counts))[:len(counts)]
        total += tokens.size
    return counts, total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="the run's Hydra overrides (data=chat, data.paths=..., model=...)")
    ap.add_argument("--min-count", type=int, default=1, metavar="N", help="keep ids seen at least N times")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.min_count < 1:
        print(f"tools/token_ids.py: --min-count={a.min_count}: must be >= 1", file=sys.stderr)
        return 2
    try:
        counts, total = data_counts(a.overrides)
    except (ConfigError, ValueError, OSError) as e:
        print(f"tools/token_ids.py: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    ids = np.flatnonzero(counts >= a.min_count).tolist()
    spec = ranges(ids)
    if a.json:
        print(json.dumps({"ids": ids, "count": len(ids), "tokens": total, "spec": spec}))
    else:
        print(spec)
        print(f"tools/token_ids.py: {len(ids)} ids of {len(counts)} seen >= {a.min_count} times in {total} tokens "
              f"(one epoch of the training split)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
