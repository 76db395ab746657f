"""The datasets of a run from its config: data=embedded (the standard library corpus), data=indexed (Megatron
.bin/.idx prefixes, blended by weight) or data=multimodal (image-text JSONL files or the embedded drawn set, with the
embedded tokenizer), split into train and valid document ranges and packed into samples."""

from __future__ import annotations

import torch.distributed as dist

from ..config import RunConfig
from ..errors import ConfigError
from .conversations import build_chat_datasets
from .corpus import EmbeddedCorpus
from .dataset import BlendedDataset, IndexedDocuments, PackedDataset, split_documents
from .indexed import IndexedDataset, IndexedDatasetError
from .media_tokens import media_tokens_of, tokenizer_encoder
from .multimodal import build_multimodal_datasets
from .tokenizer import EOD_TOKEN, eod_id, load_tokenizer

__all__ = ["build_data"]


def _parse_paths(paths) -> list:
    """[prefix, ...] (equal weights) or [weight, prefix, weight, prefix, ...] -> [(weight, prefix)]."""
    items = [str(p) for p in paths]
    try:
        float(items[0])
        weighted = True
    except ValueError:
        weighted = False
    if not weighted:
        return [(1.0, p) for p in items]
    if len(items) % 2:
        raise ConfigError("data.paths", items, "weighted form needs pairs: [weight, prefix, weight, prefix, ...]")
    try:
        return [(float(items[i]), items[i + 1]) for i in range(0, len(items), 2)]
    except ValueError:
        raise ConfigError("data.paths", items, "weighted form needs pairs: [weight, prefix, ...]") from None


def _embedded_corpus(d, rank: int) -> EmbeddedCorpus:
    """The cached embedded corpus; rank 0 builds it (once) while the others wait."""
    if rank == 0:
        corpus = EmbeddedCorpus(d.cache_dir, d.tokenizer_vocab_size)
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        corpus = EmbeddedCorpus(d.cache_dir, d.tokenizer_vocab_size, progress=False)
    return corpus


def _user_tokenizer(path: str):
    """data.tokenizer: the tokenizer.json the data was made with; a bad file is a one-line ConfigError."""
    try:
        return load_tokenizer(path)
    except (FileNotFoundError, OSError, Exception) as e:  # tokenizers raises its own exception type
        raise ConfigError("data.tokenizer", path, str(e).splitlines()[0]) from None


def _multimodal(run: RunConfig, rank: int):
    """data=multimodal: the embedded tokenizer (or data.tokenizer) and the JSONL files of data.paths."""
    d = run.data
    if not run.model.vision.enabled:  # before the tokenizer is built: the mistake is reported at once
        raise ConfigError("model.vision.enabled", False, "data=multimodal needs a model with a vision tower "
                          "(e.g. model=k3_vl_tiny)")
    if d.tokenizer:
        tok = _user_tokenizer(d.tokenizer)
        eod = tok.token_to_id(getattr(tok, "eod_token", EOD_TOKEN))  # the release's tokenizer ends with [EOS]
    else:
        corpus = _embedded_corpus(d, rank)
        tok, eod = corpus.tokenizer(), corpus.eod_id
    paths = _parse_paths(d.paths) if d.paths else []
    tokens = media_tokens_of(run.model, tok, pad=run.model.vision.placeholder_token_id + 3)
    return build_multimodal_datasets(run, paths, tokenizer_encoder(tok), tokens, eod, report=rank == 0)


def _chat(run: RunConfig, rank: int):
    """data=chat: the embedded tokenizer with K3's control tokens (or data.tokenizer: a tokenizer.json, a K3
    directory) and the JSONL files of data.paths (none: the embedded chat set)."""
    d = run.data
    tok = _user_tokenizer(d.tokenizer) if d.tokenizer else _embedded_corpus(d, rank).tokenizer()
    try:
        pad = eod_id(tok)
    except ValueError:
        pad = 0  # padding's labels are ignored: any id the model has
    paths = _parse_paths(d.paths) if d.paths else []
    return build_chat_datasets(run, paths, tok, pad, report=rank == 0)


def build_data(run: RunConfig, rank: int):
    """(train dataset, valid dataset) for data=embedded, indexed, multimodal or chat."""
    d, T, seed = run.data, run.train.seq_length, run.train.seed
    if d.name == "multimodal":
        return _multimodal(run, rank)
    if d.name == "chat":
        return _chat(run, rank)
    if d.name == "embedded":
        corpus = _embedded_corpus(d, rank)
        vocab, sources = corpus.vocab_size, [(1.0, corpus.documents)]
    else:
        sources = []
        for w, prefix in _parse_paths(d.paths):
            try:
                sources.append((w, IndexedDocuments(IndexedDataset(prefix), name=prefix)))
            except (IndexedDatasetError, FileNotFoundError, OSError) as e:
                raise ConfigError("data.paths", prefix, str(e)) from None
        vocab = _user_tokenizer(d.tokenizer).get_vocab_size() if d.tokenizer else 0
    if vocab > run.model.vocab_size:
        raise ConfigError("model.vocab_size", run.model.vocab_size, f"must be >= the tokenizer's vocabulary ({vocab})")
    splits = {"train": [], "valid": []}
    for w, docs in sources:
        ids = split_documents(len(docs), d.split)
        for name in splits:
            try:
                splits[name].append((w, PackedDataset(docs, ids[name], T, seed, f"{docs.name} ({name} split)")))
            except ValueError as e:
                raise ConfigError("train.seq_length", T, str(e)) from None
    out = []
    for name in ("train", "valid"):
        parts = splits[name]
        out.append(parts[0][1] if len(parts) == 1 else
                   BlendedDataset([p for _, p in parts], [w for w, _ in parts], name=f"{name} blend"))
    return out[0], out[1]
