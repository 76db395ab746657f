"""Byte-level BPE tokenizers (the `tokenizers` package): train deterministically, save, load."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

EOD_TOKEN = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: Path):
    """Train a byte-level BPE with one special token (end of document, id 0) and save it as
    tokenizer.json. Single-threaded training is deterministic for the same texts in the same order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(out_path)
    return tok


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    return Tokenizer.from_file(str(path))


def eod_id(tok) -> int:
    i = tok.token_to_id(EOD_TOKEN)
    if i is None:
        raise ValueError(f"tokenizer has no end-of-document token {EOD_TOKEN!r}")
    return i
