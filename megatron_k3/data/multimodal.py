"""data=multimodal: image-text (and video-text) documents packed into samples for K3's vision-language training.

Legend: T sequence length (train.seq_length), P pixel patches, M media, ps patch size, (mh, mw) merge kernel.

Documents come from JSON lines (documents.JsonlDocuments) or, without `data.paths`, the embedded drawn set
(drawings.SyntheticDocuments). Tokens: text goes through the embedded BPE (the tokenizer data=embedded trains and
caches, or data.tokenizer); each medium becomes `<|media_begin|>`, exactly (h / mh) * (w / mw) placeholder tokens,
then `<|media_end|>` (media_tokens.py), and every document ends with the end-of-document token. A video is cut into
chunks of at most model.vision.pos_emb_time frames, each chunk one medium (its frames pool into one set of
features). Pixels: pixels.MediaProcessor.

Samples. Whole documents are packed (first fit over the most recent open samples) into samples of T + 1 tokens; the
rest of a sample is padding whose labels are ignored; a document longer than a sample is cut before the media run the
cut would split (the media after the cut are dropped). The packing is fixed by train.seed and every epoch visits the
samples in a new order, so sample c of the run is a pure function of (seed, c). Documents are scanned (tokenized,
image headers read, checked) when the dataset is built; pixels are decoded and preprocessed per sample, so reading a
sample can fail mid-run (a file changed after the scan): `reads_files` says so to the Trainer.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from ..errors import BadDocument, ConfigError, DataError
from .dataset import BlendedDataset, Sample, split_documents
from .documents import JsonlDocuments, media_of
from .drawings import SyntheticDocuments
from .media_tokens import MediaTokens
from .pixels import MediaProcessor

log = logging.getLogger(__name__)

_PACK_WINDOW = 64  # open samples a document may go into (first fit)
_LOGGED_BAD = 100  # bad documents logged one by one per dataset; the rest are counted in the summary line

__all__ = ["MultimodalDataset", "build_multimodal_datasets", "jsonl_sources", "media_processor", "split_sources"]


# ----------------------------------------------------------------------------------------------------------- dataset

def _pack(lengths: np.ndarray, cap: int, rng) -> tuple:
    """Documents into samples of `cap` tokens: in a random order, each into the first of the last _PACK_WINDOW
    opened samples it fits, else a new one. Returns (doc ids concatenated by sample, offsets [S+1])."""
    samples, open_ids, free = [], [], []
    for d in rng.permutation(len(lengths)):
        n = int(lengths[d])
        k = next((k for k, f in enumerate(free) if f >= n), -1)
        if k < 0:
            samples.append([int(d)])
            open_ids.append(len(samples) - 1)
            free.append(cap - n)
            if len(open_ids) > _PACK_WINDOW:
                open_ids.pop(0)
                free.pop(0)
        else:
            samples[open_ids[k]].append(int(d))
            free[k] -= n
    offsets = np.cumsum([0] + [len(s) for s in samples])
    flat = np.asarray([d for s in samples for d in s], dtype=np.int64)
    return flat, offsets.astype(np.int64)


class _Documents:
    """What `MultimodalDataset._scan` keeps of the usable documents, in order: their ids, tokens (with offsets),
    the tokens and media a sample keeps of each, and their media's grids (with offsets)."""

    def __init__(self):
        self.ids, self.tokens, self.tok_off, self.keep_len, self.keep_media = [], [], [0], [], []
        self.grids, self.media_off, self.masks = [], [0], []

    def add(self, i: int, doc) -> None:
        """Document i as `_tokens_of` returned it (None: left out), with its per-token loss mask when it has one
        (data=chat: 1 where the token is a label to learn)."""
        if doc is None:
            return
        out, cut, kept_media, grids, n_media = doc[:5]
        if len(doc) > 5:
            self.masks.append(np.asarray(doc[5][:cut], dtype=bool))
        self.ids.append(int(i))
        self.tokens.append(np.asarray(out, dtype=np.int64))
        self.tok_off.append(self.tok_off[-1] + len(out))
        self.keep_len.append(cut)
        self.keep_media.append(kept_media)
        self.grids.extend(grids)
        self.media_off.append(self.media_off[-1] + n_media)


class MultimodalDataset:
    """Samples of seq_length + 1 tokens, each a whole number of documents (with their media) of `source`.

    `source` has len(), where(i), document(i) -> (text, images, videos), size(handle) and load(handle) (see
    JsonlDocuments, SyntheticDocuments). The documents `doc_ids` are scanned here: tokenized, their media measured
    from the file headers and checked; a bad one is logged once (when `report`) and left out
    (on_bad_sample='skip', counted in `self.skipped`) or raises DataError (on_bad_sample='stop')."""

    reads_files = True  # a sample's pixels are read when it is: a file changed after the scan fails then

    def __init__(self, source, doc_ids, seq_length: int, seed: int, *, encode: Callable, eod_id: int | None,
                 media_tokens: MediaTokens, processor: MediaProcessor, on_bad_sample: str = "skip",
                 name: str = "multimodal", report: bool = True):
        if on_bad_sample not in ("skip", "stop"):
            raise ValueError(f"on_bad_sample must be skip or stop, got {on_bad_sample!r}")
        self.source, self.seq_length, self.seed, self.name = source, seq_length, seed, name
        self.encode, self.eod_id, self.tokens, self.processor = encode, eod_id, media_tokens, processor
        self.on_bad_sample, self.report = on_bad_sample, report
        self.skipped: list = []  # (where, problem) of the documents left out
        self._scan(np.asarray(doc_ids, dtype=np.int64))
        if not len(self.doc_ids):
            raise ValueError(f"{name}: no usable documents (of {len(doc_ids)}; {len(self.skipped)} left out as bad)")
        self.packed_docs, self.sample_offsets = _pack(self.keep_len, seq_length + 1,
                                                      np.random.default_rng([seed, 0x6D6D, 0]))
        self.samples_per_epoch = len(self.sample_offsets) - 1
        self._epoch = None
        self._ignore = np.asarray(self.tokens.ids, dtype=np.int64)

    # ---------------------------------------------------------------- scan
    def _bad(self, i: int, problem: str):
        where = self.source.where(int(i))
        if self.on_bad_sample == "stop":
            raise DataError(where, f"{problem} (data.on_bad_sample=stop; 'skip' leaves such documents out)")
        self.skipped.append((where, problem))
        if self.report and len(self.skipped) <= _LOGGED_BAD:
            log.warning("%s: bad document %s: %s; left out (data.on_bad_sample=skip)", self.name, where, problem)

    def _media(self, i: int) -> tuple:
        """(text pieces [n+1], media [n]: ('image' | 'video', frame handles)) of document i; BadDocument."""
        return media_of(*self.source.document(int(i)))

    def _chunked(self, media: list) -> list:
        """The media as the model sees them: an image, or a video's chunks of at most chunk_frames frames."""
        step = self.processor.chunk_frames
        return [frames[c: c + step] for _, frames in media for c in range(0, len(frames), step)]

    def _structure(self, i: int) -> tuple:
        """(text pieces [n+1], grids [n]) of document i: grids[k], the grids of marker k's image or video chunks,
        measured from the file headers. BadDocument for what the model could not take."""
        pieces, media = self._media(i)
        p, out = self.processor, []
        for _, frames in media:
            sizes = [self.source.size(h) for h in frames]
            if len(set(sizes)) > 1:
                raise BadDocument(f"video frames of different sizes {sorted(set(sizes))} ({frames[0]} ...)")
            out.append([p.grid(*sizes[0], frames=len(chunk)) for chunk in self._chunked([(None, frames)])])
            for grid in out[-1]:
                p.num_tokens(grid)  # the merge-kernel check
        return pieces, out

    def _scan(self, doc_ids: np.ndarray, batch: int = 512):
        """Tokenise every document (text in batches of `batch` documents), leave out the bad ones, and keep what
        sampling needs: the usable documents' ids, their tokens, the tokens a sample keeps of each, its media."""
        docs = _Documents()
        for b in range(0, len(doc_ids), batch):
            ids, structs = doc_ids[b: b + batch], []
            for i in ids:
                try:
                    structs.append(self._structure(i))
                except BadDocument as e:
                    self._bad(i, str(e))
                    structs.append(None)
            encoded = self._encoded(structs)
            for i, s in zip(ids, structs):
                if s is not None:
                    docs.add(i, self._tokens_of(i, *s, encoded))
        if self.skipped and self.report:
            more = len(self.skipped) - _LOGGED_BAD
            log.warning("%s: %d of %d documents left out as bad (data.on_bad_sample=skip)%s", self.name,
                        len(self.skipped), len(doc_ids), f"; {more} not logged one by one" if more > 0 else "")
        dtype = np.int64 if (max(self.tokens.ids) >= 2 ** 31) else np.int32
        self.doc_ids = np.asarray(docs.ids, dtype=np.int64)  # source ids of the usable documents
        self._tokens = np.concatenate(docs.tokens).astype(dtype) if docs.tokens else np.zeros(0, dtype)
        self._tok_off = np.asarray(docs.tok_off, dtype=np.int64)
        self.keep_len = np.asarray(docs.keep_len, dtype=np.int64)
        self.keep_media = np.asarray(docs.keep_media, dtype=np.int64)
        self.grids = np.asarray(docs.grids, dtype=np.int64).reshape(-1, 3)
        self._media_off = np.asarray(docs.media_off, dtype=np.int64)
        self._masks = np.concatenate(docs.masks) if docs.masks else None  # over the kept tokens, document by document
        self._mask_off = np.concatenate([[0], np.cumsum(self.keep_len)]).astype(np.int64)

    def _encoded(self, structs: list):
        """The token ids of a batch of `_structure` results' text pieces, in order (an iterator)."""
        flat = [t for s in structs if s is not None for t in s[0]]
        return iter(self.encode(flat) if flat else [])

    def _tokens_of(self, i: int, pieces: list, media: list, encoded):
        """Document i's tokens (its text pieces' ids from `encoded`, each medium's begin, placeholders and end after
        the piece before it, EOD), the tokens a sample keeps of it (never cutting a medium) and the media those
        hold, as (tokens, kept tokens, kept media, its media's grids, its media count); None for a document left
        out (empty, media longer than a sample, or only media once cut)."""
        cap, mt, p = self.seq_length + 1, self.tokens, self.processor
        out, spans = [], []
        for k in range(len(pieces)):
            out.extend(next(encoded))
            for grid in media[k] if k < len(media) else ():  # an image, or a video's chunks back to back
                n = p.num_tokens(grid)
                spans.append((len(out), len(out) + n + 1))  # positions of begin and end
                out.extend([mt.begin] + [mt.placeholder] * n + [mt.end])
        if self.eod_id is not None:
            out.append(self.eod_id)
        media_len = sum(e - b0 + 1 for b0, e in spans)
        if media_len > cap:
            self._bad(i, f"its media need {media_len} tokens, more than a sample of train.seq_length+1="
                         f"{cap} (raise train.seq_length or lower data.image_max_patches)")
            return None
        if not spans and not any(pieces):
            return None  # an empty document contributes nothing (as in PackedDataset)
        cut = min(len(out), cap)
        for b0, e in spans:
            if b0 < cut <= e:  # the cut would split this run: cut before it
                cut = b0
        if cut < len(out) and np.isin(out[1:cut], mt.ids).all():
            self._bad(i, f"cut to a sample of train.seq_length+1={cap} tokens it keeps only media, no text "
                         f"to learn (raise train.seq_length)")
            return None
        return (out, cut, sum(1 for _, e in spans if e < cut), [g for marker in media for g in marker], len(spans))

    # ---------------------------------------------------------------- samples
    def __len__(self) -> int:
        return self.samples_per_epoch

    def _order(self, epoch: int) -> np.ndarray:
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, np.random.default_rng([self.seed, 0x6D6D, 1, epoch]).permutation(
                self.samples_per_epoch))
        return self._epoch[1]

    def documents_of(self, c: int) -> np.ndarray:
        """Indices (into self.doc_ids) of the documents of sample c, in order."""
        epoch, j = divmod(int(c), self.samples_per_epoch)
        s = int(self._order(epoch)[j])
        return self.packed_docs[self.sample_offsets[s]: self.sample_offsets[s + 1]]

    def _pixels(self, d: int) -> list:
        """[(patches, grid)] of the kept media of document d (index into self.doc_ids)."""
        n = int(self.keep_media[d])
        if not n:
            return []
        i = int(self.doc_ids[d])
        try:
            out = []
            for k, frames in enumerate(self._chunked(self._media(i)[1])[:n]):
                patches, g = self.processor.chunk([self.source.load(h) for h in frames])
                if tuple(g) != tuple(self.grids[self._media_off[d] + k]):
                    raise BadDocument(f"a medium's grid {g} differs from the start-up scan's "
                                      f"{tuple(self.grids[self._media_off[d] + k])} (was a file changed?)")
                out.append((patches, g))
        except BadDocument as e:  # the scan passed, so a file changed or cannot be decoded: no sample to fall back to
            raise DataError(self.source.where(i), str(e)) from None
        return out

    def sample(self, c: int) -> Sample:
        """Sample number c of the run (0-based, over all epochs)."""
        cap, ps = self.seq_length + 1, getattr(self.processor, "patch_size", 0)
        tokens = np.full(cap, self.tokens.pad, dtype=np.int64)
        starts, patches, grids, pos = [], [], [], 0
        for d in self.documents_of(c):
            n = int(self.keep_len[d])
            tokens[pos: pos + n] = self._tokens[self._tok_off[d]: self._tok_off[d] + n]
            starts.append(pos)
            for x, g in self._pixels(int(d)):
                patches.append(x)
                grids.append(g)
            pos += n
        if pos < cap:
            starts.append(pos)  # the padding is a segment of its own
        if self.processor is None:  # data=chat for a text model: no media
            return Sample(tokens, np.asarray(starts, dtype=np.int64), loss_mask=self._loss_mask(c, tokens))
        return Sample(tokens, np.asarray(starts, dtype=np.int64),
                      pixel_values=(np.concatenate(patches) if patches else np.zeros((0, 3, ps, ps), np.float32)),
                      grid_thws=np.asarray(grids, dtype=np.int64).reshape(-1, 3),
                      loss_mask=self._loss_mask(c, tokens))

    def _loss_mask(self, c: int, tokens: np.ndarray) -> np.ndarray:
        """[T] aligned with the labels tokens[1:]: the documents' own masks when they have them (data=chat), else
        every token but the media tokens and padding."""
        if self._masks is None:
            return ~np.isin(tokens[1:], self._ignore)
        keep = np.zeros(len(tokens), dtype=bool)
        pos = 0
        for d in self.documents_of(c):
            n = int(self.keep_len[d])
            keep[pos: pos + n] = self._masks[self._mask_off[d]: self._mask_off[d] + n]
            pos += n
        return keep[1:]


# ------------------------------------------------------------------------------------------------------------ build

def media_processor(run) -> MediaProcessor:
    """The pixel preprocessing of a vision-language run (data.image_max_patches, image_max_side_patches)."""
    d, v = run.data, run.model.vision
    mh, mw = (int(x) for x in v.merge_kernel_size)
    side = d.image_max_side_patches
    if -(-side // max(mh, mw)) * max(mh, mw) > v.rope_max_grid:
        raise ConfigError("data.image_max_side_patches", side, f"padded to the merge kernel it must stay <= "
                          f"model.vision.rope_max_grid={v.rope_max_grid}")
    return MediaProcessor(v.patch_size, (mh, mw), d.image_max_patches, side, v.pos_emb_time)


def build_multimodal_datasets(run, paths: list, encode: Callable, tokens: MediaTokens, eod_id: int | None,
                              report: bool = True) -> tuple:
    """(train, valid) for data=multimodal: `paths` [(weight, JSONL path)] (empty: the embedded default), split by
    data.split, blended by weight when there are several files; `tokens` the media ids (media_tokens.py)."""
    d = run.data
    processor = media_processor(run)
    sources = jsonl_sources(paths, JsonlDocuments) if paths else [(1.0, SyntheticDocuments())]
    return split_sources(run, sources, lambda src, ids, name: MultimodalDataset(
        src, ids, run.train.seq_length, run.train.seed, encode=encode, eod_id=eod_id, media_tokens=tokens,
        processor=processor, on_bad_sample=d.on_bad_sample, name=name, report=report))


def jsonl_sources(paths: list, kind) -> list:
    """[(weight, kind(path))] for data.paths [(weight, JSONL path)]; a file that cannot be read is a ConfigError."""
    out = []
    for w, p in paths:
        try:
            out.append((w, kind(p)))
        except OSError as e:
            raise ConfigError("data.paths", p, f"cannot read the JSONL file: {e.strerror or e}") from None
    return out


def split_sources(run, sources: list, make: Callable) -> tuple:
    """(train, valid): each source's documents split by data.split, `make(source, ids, name)` a dataset of each
    part, blended by weight when there are several sources."""
    out = []
    for split in ("train", "valid"):
        parts = []
        for w, src in sources:
            ids = split_documents(len(src), run.data.split)[split]
            if not len(ids):
                raise ConfigError("data.split", run.data.split, f"leaves no documents for the {split} split of "
                                  f"{src.name} ({len(src)} documents)")
            try:
                parts.append((w, make(src, ids, f"{src.name} ({split} split)")))
            except ValueError as e:
                if isinstance(e, ConfigError):
                    raise
                raise ConfigError("data.paths", src.name, str(e)) from None
        out.append(parts[0][1] if len(parts) == 1 else
                   BlendedDataset([p for _, p in parts], [w for w, _ in parts], name=f"{split} blend"))
    return out[0], out[1]
