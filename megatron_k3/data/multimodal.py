"""data=multimodal: image-text (and video-text) documents packed into samples for K3's vision-language training.

Legend: T sequence length (train.seq_length), P pixel patches, M media, ps patch size, (mh, mw) merge kernel.

Documents. A user's data is JSON lines, one document per line (paths relative to the JSONL file):

    {"text": "A photo: <image> and a clip <video> ...", "images": ["a.png"], "videos": [["f0.png", "f1.png"]]}

Every `<image>` marker takes the next entry of "images", every `<video>` the next entry of "videos" (a list of frame
files of one size). Without `data.paths` the embedded default is used: procedurally drawn images (coloured shapes,
seven-segment digits) and short videos (a shape moving across the frames) with captions that describe them, the same
for every run (no download).

Tokens. Text goes through the embedded BPE (the tokenizer data=embedded trains and caches); each medium becomes
`<|media_begin|>`, exactly (h / mh) * (w / mw) placeholder tokens (model.vision.placeholder_token_id), then
`<|media_end|>`, and every document ends with the end-of-document token. A video is cut into chunks of at most
model.vision.pos_emb_time frames, each chunk one medium (its frames pool into one set of features).

Pixels, as the released K3 / K2.5 processor: RGB; scaled down (bicubic, keeping the aspect) when it has more than
`data.image_max_patches` patches or a side over `data.image_max_side_patches` patches; padded with black at the
bottom and right to a multiple of ps * merge; `(x / 255 - 0.5) / 0.5`; patchified to [t * (H/ps) * (W/ps), 3, ps, ps]
in (frame, patch row, patch column) order; grid (t, H/ps, W/ps).

Samples. Whole documents are packed (first fit over the most recent open samples) into samples of T + 1 tokens; the
rest of a sample is padding whose labels are ignored; a document longer than a sample is cut before the media run the
cut would split (the media after the cut are dropped). The packing is fixed by train.seed and every epoch visits the
samples in a new order, so sample c of the run is a pure function of (seed, c). Documents are scanned (tokenized,
image headers read, checked) when the dataset is built; pixels are decoded and preprocessed per sample.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
from PIL import Image, ImageDraw

from ..errors import ConfigError
from .dataset import BlendedDataset, Sample, split_documents

log = logging.getLogger(__name__)

IMAGE_MARKER, VIDEO_MARKER = "<image>", "<video>"
_MARKERS = re.compile(r"(<image>|<video>)")
EMBEDDED_DOCUMENTS = 20000  # documents of the embedded default
_PACK_WINDOW = 64  # open samples a document may go into (first fit)
_LOGGED_BAD = 100  # bad documents logged one by one per dataset; the rest are counted in the summary line

__all__ = ["DataError", "MediaTokens", "MediaProcessor", "JsonlDocuments", "SyntheticDocuments", "MultimodalDataset",
           "build_multimodal_datasets", "media_tokens_for", "tokenizer_encoder"]


class DataError(ConfigError):
    """A bad document under data.on_bad_sample=stop (or a file that changed after the scan): one line naming the
    document (file:line) and the problem. A ConfigError, so the entry point reports it as one line and exits 2."""

    def __init__(self, where: str, problem: str):
        self.key, self.value, self.valid = "data.paths", where, problem
        self.where, self.problem = where, problem
        ValueError.__init__(self, f"bad document {where}: {problem}")


class BadDocument(Exception):
    """Raised while reading or scanning one document; the message is the problem."""


# ---------------------------------------------------------------------------------------------------------- tokens

@dataclass(frozen=True)
class MediaTokens:
    """The ids around and inside a medium's run, and the padding id; the placeholder is the model's."""
    placeholder: int
    begin: int
    end: int
    pad: int

    @classmethod
    def after(cls, placeholder: int) -> "MediaTokens":
        """placeholder, <|media_begin|> = placeholder + 1, <|media_end|> = + 2, <|pad|> = + 3."""
        return cls(placeholder, placeholder + 1, placeholder + 2, placeholder + 3)

    @property
    def ids(self) -> tuple:
        return self.placeholder, self.begin, self.end, self.pad


def media_tokens_for(model, text_vocab: int) -> MediaTokens:
    """The media ids for `model` (a ModelConfig) over a tokenizer of `text_vocab` ids, or a ConfigError naming the
    key to change."""
    v = model.vision
    if not v.enabled:
        raise ConfigError("model.vision.enabled", False, "data=multimodal needs a model with a vision tower "
                          "(e.g. model=k3_vl_tiny)")
    t = MediaTokens.after(v.placeholder_token_id)
    if t.placeholder < text_vocab:
        raise ConfigError("model.vision.placeholder_token_id", t.placeholder,
                          f"must be >= the tokenizer's vocabulary ({text_vocab}): data=multimodal uses ids "
                          f"{t.placeholder}..{t.pad} for the media tokens, above the text ids")
    if t.pad >= model.vocab_size:
        raise ConfigError("model.vocab_size", model.vocab_size,
                          f"must be > {t.pad}: data=multimodal uses {t.placeholder} (placeholder), {t.begin} "
                          f"<|media_begin|>, {t.end} <|media_end|> and {t.pad} <|pad|>")
    return t


def tokenizer_encoder(tok) -> Callable:
    """texts -> lists of ids, for a `tokenizers.Tokenizer`."""
    return lambda texts: [e.ids for e in tok.encode_batch(list(texts))]


# ------------------------------------------------------------------------------------------------------ preprocessing

@dataclass(frozen=True)
class MediaProcessor:
    """Pixel preprocessing and feature counts (the released K3 / K2.5 processor's rules)."""
    patch_size: int = 14
    merge_kernel_size: tuple = (2, 2)
    max_patches: int = 256  # data.image_max_patches (the released in_patch_limit)
    max_side_patches: int = 512  # data.image_max_side_patches (patch_limit_on_one_side)
    chunk_frames: int = 4  # model.vision.pos_emb_time: frames per video chunk

    def fit(self, width: int, height: int) -> tuple:
        """(width, height) after the scale-down, exactly as the released processor computes it."""
        ps, side = self.patch_size, self.max_side_patches
        s1 = math.sqrt(self.max_patches / (max(1.0, width // ps) * max(1.0, height // ps)))
        scale = min(1.0, s1, side * ps / width, side * ps / height)
        return (min(max(1, int(width * scale)), side * ps), min(max(1, int(height * scale)), side * ps))

    def padded(self, width: int, height: int) -> tuple:
        """(width, height) after padding to a multiple of patch_size * merge kernel."""
        fh, fw = self.patch_size * self.merge_kernel_size[0], self.patch_size * self.merge_kernel_size[1]
        return -(-width // fw) * fw, -(-height // fh) * fh

    def grid(self, width: int, height: int, frames: int = 1) -> tuple:
        """(t, h, w) in patches of a medium whose frames are `width` x `height` pixels before preprocessing."""
        w, h = self.padded(*self.fit(width, height))
        return frames, h // self.patch_size, w // self.patch_size

    def num_tokens(self, grid) -> int:
        """Placeholder tokens of a medium: (h / mh) * (w / mw) (a chunk's frames pool into one set)."""
        t, h, w = (int(x) for x in grid)
        mh, mw = self.merge_kernel_size
        if h % mh or w % mw or not 1 <= t <= self.chunk_frames or h < 1 or w < 1:
            raise BadDocument(f"a medium's grid (t, h, w)=({t}, {h}, {w}) does not fit model.vision."
                              f"merge_kernel_size={list(self.merge_kernel_size)} (h, w multiples of it) with "
                              f"1 <= t <= model.vision.pos_emb_time={self.chunk_frames}")
        return (h // mh) * (w // mw)

    def _pixels(self, img: Image.Image) -> np.ndarray:
        """[H, W, 3] uint8: RGB, scaled down if needed, padded with black (bottom, right)."""
        img = img.convert("RGB")
        size = self.fit(*img.size)
        if size != img.size:
            img = img.resize(size, Image.Resampling.BICUBIC)
        w, h = self.padded(*size)
        out = np.zeros((h, w, 3), dtype=np.uint8)
        out[: size[1], : size[0]] = np.asarray(img, dtype=np.uint8)
        return out

    def chunk(self, frames: list) -> tuple:
        """(patches [t*(H/ps)*(W/ps), 3, ps, ps] float32, grid (t, H/ps, W/ps)) of one image or video chunk."""
        if not 1 <= len(frames) <= self.chunk_frames:
            raise ValueError(f"a chunk holds 1..{self.chunk_frames} frames, got {len(frames)}")
        arrs = [self._pixels(f) for f in frames]
        if len({a.shape for a in arrs}) > 1:
            raise BadDocument(f"video frames of different sizes: {sorted({f.size for f in frames})}")
        x = (np.stack(arrs).astype(np.float32) / np.float32(255.0) - np.float32(0.5)) / np.float32(0.5)
        t, H, W, C = x.shape
        ps = self.patch_size
        patches = x.reshape(t, H // ps, ps, W // ps, ps, C).transpose(0, 1, 3, 5, 2, 4)
        return np.ascontiguousarray(patches.reshape(-1, C, ps, ps)), (t, H // ps, W // ps)

    def image(self, img: Image.Image) -> tuple:
        return self.chunk([img])

    def video(self, frames: list) -> list:
        """[(patches, grid)] for the chunks of at most chunk_frames frames."""
        return [self.chunk(frames[i: i + self.chunk_frames]) for i in range(0, len(frames), self.chunk_frames)]


# ---------------------------------------------------------------------------------------------------------- sources

def _media_of(text: str, images: list, videos: list) -> tuple:
    """(text pieces [n+1], media [n]) for the n markers, in order: media[k] = ('image' | 'video', frame handles) goes
    between pieces k and k+1 (a video is cut into chunks later). BadDocument when the markers and lists disagree."""
    parts = _MARKERS.split(text)
    n_img, n_vid = parts[1::2].count(IMAGE_MARKER), parts[1::2].count(VIDEO_MARKER)
    if n_img != len(images) or n_vid != len(videos):
        raise BadDocument(f"{n_img} {IMAGE_MARKER} and {n_vid} {VIDEO_MARKER} markers in the text for "
                          f"{len(images)} images and {len(videos)} videos")
    it_img, it_vid, media = iter(images), iter(videos), []
    for m in parts[1::2]:
        if m == IMAGE_MARKER:
            media.append(("image", [next(it_img)]))
        else:
            frames = next(it_vid)
            if not frames:
                raise BadDocument("a video with no frames")
            media.append(("video", list(frames)))
    return parts[0::2], media


class JsonlDocuments:
    """The documents of one JSONL file (one JSON object per non-blank line), read line by line on demand."""

    def __init__(self, path):
        self.path = Path(path)
        self.base, self.name = self.path.parent, str(path)
        offsets, lines, pos = [], [], 0
        with open(self.path, "rb") as f:  # FileNotFoundError / OSError for the caller
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    offsets.append(pos)
                    lines.append(lineno)
                pos += len(line)
        self.offsets, self.lines = np.asarray(offsets, dtype=np.int64), np.asarray(lines, dtype=np.int64)
        self._fh = None

    def __len__(self) -> int:
        return len(self.offsets)

    def __del__(self):
        if getattr(self, "_fh", None) is not None:
            self._fh.close()

    def where(self, i: int) -> str:
        return f"{self.path}:{int(self.lines[i])}"

    def _line(self, i: int) -> bytes:
        if self._fh is None:
            self._fh = open(self.path, "rb")
        self._fh.seek(int(self.offsets[i]))
        return self._fh.readline()

    def _path(self, p) -> str:
        if not isinstance(p, str) or not p:
            raise BadDocument(f"a media path must be a non-empty string, got {p!r}")
        return str(self.base / p)

    def document(self, i: int) -> tuple:
        """(text, [image handle], [[frame handle]]); handles are file paths."""
        try:
            rec = json.loads(self._line(i))
        except ValueError as e:
            raise BadDocument(f"not valid JSON ({e})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise BadDocument('expected a JSON object with a string "text"')
        images, videos = rec.get("images") or [], rec.get("videos") or []
        if not isinstance(images, list) or not isinstance(videos, list) or \
                not all(isinstance(v, list) for v in videos):
            raise BadDocument('"images" must be a list of paths and "videos" a list of lists of frame paths')
        return rec["text"], [self._path(p) for p in images], [[self._path(p) for p in v] for v in videos]

    @staticmethod
    def size(handle) -> tuple:
        """(width, height) from the file's header (no decoding)."""
        try:
            with Image.open(handle) as im:
                return im.size
        except FileNotFoundError:
            raise BadDocument(f"image file not found: {handle}") from None
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise BadDocument(f"cannot read image {handle}: {e}") from None

    @staticmethod
    def load(handle) -> Image.Image:
        try:
            with Image.open(handle) as im:
                return im.convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise BadDocument(f"cannot decode image {handle}: {e}") from None


class _Drawing(NamedTuple):
    """One procedurally drawn frame: size, colours and a shape (or a digit) at a centre."""
    width: int
    height: int
    background: tuple
    color: tuple
    shape: str  # circle, square, triangle, diamond, or a digit '0'..'9'
    cx: int
    cy: int
    radius: int


COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (240, 210, 40),
          "white": (245, 245, 245), "black": (20, 20, 20), "orange": (245, 140, 30), "purple": (140, 60, 200)}
SHAPES = ("circle", "square", "triangle", "diamond")
ROWS, COLUMNS = ("top", "middle", "bottom"), ("left", "center", "right")
# seven-segment digits: segments a (top), b (top right), c (bottom right), d (bottom), e (bottom left), f (top left),
# g (middle)
SEGMENTS = {"0": "abcdef", "1": "bc", "2": "abdeg", "3": "abcdg", "4": "bcfg", "5": "acdfg", "6": "acdefg",
            "7": "abc", "8": "abcdefg", "9": "abcdfg"}
IMAGE_SIZES_W, IMAGE_SIZES_H = (56, 70, 84, 98, 112), (56, 70, 84)
VIDEO_SIZES = ((84, 56), (112, 84), (84, 84))
DIRECTIONS = ("from left to right", "from right to left", "from top to bottom", "from bottom to top")


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _position_name(r: int, c: int) -> str:
    if r == 1 and c == 1:
        return "center"
    return f"{ROWS[r]} {COLUMNS[c]}"


def draw(d: _Drawing) -> Image.Image:
    """The frame `d` describes (integer geometry, no anti-aliasing: the same pixels everywhere)."""
    img = Image.new("RGB", (d.width, d.height), d.background)
    g = ImageDraw.Draw(img)
    x, y, r = d.cx, d.cy, d.radius
    if d.shape == "circle":
        g.ellipse([x - r, y - r, x + r, y + r], fill=d.color)
    elif d.shape == "square":
        g.rectangle([x - r, y - r, x + r, y + r], fill=d.color)
    elif d.shape == "triangle":
        g.polygon([(x, y - r), (x + r, y + r), (x - r, y + r)], fill=d.color)
    elif d.shape == "diamond":
        g.polygon([(x, y - r), (x + r, y), (x, y + r), (x - r, y)], fill=d.color)
    else:  # a digit, 2r high and r wide, strokes of r/4
        w, s = r // 2, max(2, r // 4)
        box = {"a": (-w, -r, w, -r + s), "d": (-w, r - s, w, r), "g": (-w, -s // 2, w, s - s // 2),
               "f": (-w, -r, -w + s, 0), "b": (w - s, -r, w, 0), "e": (-w, 0, -w + s, r), "c": (w - s, 0, w, r)}
        for seg in SEGMENTS[d.shape]:
            x0, y0, x1, y1 = box[seg]
            g.rectangle([x + x0, y + y0, x + x1 - 1, y + y1 - 1], fill=d.color)
    return img


class SyntheticDocuments:
    """The embedded default: `num_documents` captioned images and videos drawn from (seed, index), no download.

    Kinds: a shape in one of nine places ("<image> A red circle in the top left on a blue background."), a digit,
    two images in one document, and a video of 4 or 6 frames (chunks of 4 and 2) of a shape moving across. Every
    caption follows its media, so it is predictable from the pixels."""

    def __init__(self, num_documents: int | None = None, seed: int = 0):
        self.num_documents = EMBEDDED_DOCUMENTS if num_documents is None else int(num_documents)
        self.seed, self.name = seed, "embedded multimodal set"

    def __len__(self) -> int:
        return self.num_documents

    def where(self, i: int) -> str:
        return f"embedded multimodal document {i}"

    @staticmethod
    def _colors(u0: float, u1: float) -> tuple:
        names = list(COLORS)
        bg = names[int(u0 * len(names))]
        rest = [n for n in names if n != bg]
        return bg, rest[int(u1 * len(rest))]

    def _shape_image(self, u) -> tuple:
        """(drawing, caption words) of a shape in one of nine places; u: 7 uniforms."""
        W, H = IMAGE_SIZES_W[int(u[0] * 5)], IMAGE_SIZES_H[int(u[1] * 3)]
        bg, fg = self._colors(u[2], u[3])
        shape, r, c = SHAPES[int(u[4] * 4)], int(u[5] * 3), int(u[6] * 3)
        rad = max(4, int(0.4 * min(W, H) / 3))
        d = _Drawing(W, H, COLORS[bg], COLORS[fg], shape, int((2 * c + 1) * W / 6), int((2 * r + 1) * H / 6), rad)
        return d, f"{_a(fg)} {fg} {shape} in the {_position_name(r, c)}", bg

    def document(self, i: int) -> tuple:
        """(text, [image handle], [[frame handle]]); handles are _Drawing tuples."""
        if not 0 <= i < self.num_documents:
            raise IndexError(i)
        u = np.random.default_rng([self.seed, i]).random(24)
        kind = u[0]
        if kind < 0.5:  # one shape
            d, what, bg = self._shape_image(u[1:8])
            template = int(u[8] * 3)
            text = (f"{IMAGE_MARKER} {what[0].upper()}{what[1:]} on {_a(bg)} {bg} background." if template == 0 else
                    f"Image: {IMAGE_MARKER}\nCaption: {what}, {bg} background." if template == 1 else
                    f"{IMAGE_MARKER} This picture shows {what}. The background is {bg}.")
            return text, [d], []
        if kind < 0.7:  # a digit
            W, H = IMAGE_SIZES_W[int(u[1] * 5)], IMAGE_SIZES_H[int(u[2] * 3)]
            bg, fg = self._colors(u[3], u[4])
            digit = str(int(u[5] * 10))
            d = _Drawing(W, H, COLORS[bg], COLORS[fg], digit, W // 2, H // 2, int(0.35 * H))
            return f"{IMAGE_MARKER} The digit {digit} in {fg} on {_a(bg)} {bg} background.", [d], []
        if kind < 0.85:  # two images
            d1, what1, bg1 = self._shape_image(u[1:8])
            d2, what2, bg2 = self._shape_image(u[8:15])
            return (f"First image: {IMAGE_MARKER} {what1} on {bg1}. Second image: {IMAGE_MARKER} {what2} on {bg2}.",
                    [d1, d2], [])
        W, H = VIDEO_SIZES[int(u[1] * 3)]  # a video: a shape moving across the frames
        bg, fg = self._colors(u[2], u[3])
        shape, direction = SHAPES[int(u[4] * 4)], int(u[5] * 4)
        n = 4 if u[6] < 0.7 else 6
        rad = max(4, int(0.4 * min(W, H) / 3))
        frames = []
        for k in range(n):
            f = (1 + 4 * k / (n - 1)) / 6  # from 1/6 to 5/6 of the way across
            f = f if direction in (0, 2) else 1 - f
            cx, cy = (int(f * W), H // 2) if direction < 2 else (W // 2, int(f * H))
            frames.append(_Drawing(W, H, COLORS[bg], COLORS[fg], shape, cx, cy, rad))
        return (f"{VIDEO_MARKER} {_a(fg).capitalize()} {fg} {shape} moving {DIRECTIONS[direction]} on {_a(bg)} {bg} "
                "background.", [], [frames])

    @staticmethod
    def size(handle) -> tuple:
        return handle.width, handle.height

    @staticmethod
    def load(handle) -> Image.Image:
        return draw(handle)


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


class MultimodalDataset:
    """Samples of seq_length + 1 tokens, each a whole number of documents (with their media) of `source`.

    `source` has len(), where(i), document(i) -> (text, images, videos), size(handle) and load(handle) (see
    JsonlDocuments, SyntheticDocuments). The documents `doc_ids` are scanned here: tokenized, their media measured
    from the file headers and checked; a bad one is logged once (when `report`) and left out
    (on_bad_sample='skip', counted in `self.skipped`) or raises DataError (on_bad_sample='stop')."""

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
        return _media_of(*self.source.document(int(i)))

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
        cap, mt, p = self.seq_length + 1, self.tokens, self.processor
        good, toks, tok_off, keep_len, keep_media, grids, media_off = [], [], [0], [], [], [], [0]
        for b in range(0, len(doc_ids), batch):
            ids, structs = doc_ids[b: b + batch], []
            for i in ids:
                try:
                    structs.append(self._structure(i))
                except BadDocument as e:
                    self._bad(i, str(e))
                    structs.append(None)
            flat = [t for s in structs if s is not None for t in s[0]]
            encoded = iter(self.encode(flat) if flat else [])
            for i, s in zip(ids, structs):
                if s is None:
                    continue
                pieces, media = s
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
                    continue
                if not spans and not any(pieces):
                    continue  # an empty document contributes nothing (as in PackedDataset)
                cut = min(len(out), cap)
                for b0, e in spans:
                    if b0 < cut <= e:  # the cut would split this run: cut before it
                        cut = b0
                if cut < len(out) and np.isin(out[1:cut], mt.ids).all():
                    self._bad(i, f"cut to a sample of train.seq_length+1={cap} tokens it keeps only media, no text "
                                 f"to learn (raise train.seq_length)")
                    continue
                good.append(int(i))
                toks.append(np.asarray(out, dtype=np.int64))
                tok_off.append(tok_off[-1] + len(out))
                keep_len.append(cut)
                keep_media.append(sum(1 for _, e in spans if e < cut))
                grids.extend(g for marker in media for g in marker)
                media_off.append(media_off[-1] + len(spans))
        if self.skipped and self.report:
            more = len(self.skipped) - _LOGGED_BAD
            log.warning("%s: %d of %d documents left out as bad (data.on_bad_sample=skip)%s", self.name,
                        len(self.skipped), len(doc_ids), f"; {more} not logged one by one" if more > 0 else "")
        dtype = np.int64 if (max(mt.ids) >= 2 ** 31) else np.int32
        self.doc_ids = np.asarray(good, dtype=np.int64)  # source ids of the usable documents
        self._tokens = np.concatenate(toks).astype(dtype) if toks else np.zeros(0, dtype)
        self._tok_off = np.asarray(tok_off, dtype=np.int64)
        self.keep_len = np.asarray(keep_len, dtype=np.int64)
        self.keep_media = np.asarray(keep_media, dtype=np.int64)
        self.grids = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
        self._media_off = np.asarray(media_off, dtype=np.int64)

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
        cap, ps = self.seq_length + 1, self.processor.patch_size
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
        return Sample(tokens, np.asarray(starts, dtype=np.int64),
                      pixel_values=(np.concatenate(patches) if patches else np.zeros((0, 3, ps, ps), np.float32)),
                      grid_thws=np.asarray(grids, dtype=np.int64).reshape(-1, 3),
                      loss_mask=~np.isin(tokens[1:], self._ignore))


# ------------------------------------------------------------------------------------------------------------ build

def build_multimodal_datasets(run, paths: list, encode: Callable, text_vocab: int, eod_id: int | None,
                              report: bool = True) -> tuple:
    """(train, valid) for data=multimodal: `paths` [(weight, JSONL path)] (empty: the embedded default), split by
    data.split, blended by weight when there are several files."""
    d, v = run.data, run.model.vision
    tokens = media_tokens_for(run.model, text_vocab)
    mh, mw = (int(x) for x in v.merge_kernel_size)
    side = d.image_max_side_patches
    if -(-side // max(mh, mw)) * max(mh, mw) > v.rope_max_grid:
        raise ConfigError("data.image_max_side_patches", side, f"padded to the merge kernel it must stay <= "
                          f"model.vision.rope_max_grid={v.rope_max_grid}")
    processor = MediaProcessor(v.patch_size, (mh, mw), d.image_max_patches, side, v.pos_emb_time)
    if paths:
        sources = []
        for w, p in paths:
            try:
                sources.append((w, JsonlDocuments(p)))
            except OSError as e:
                raise ConfigError("data.paths", p, f"cannot read the JSONL file: {e.strerror or e}") from None
    else:
        sources = [(1.0, SyntheticDocuments())]
    out = []
    for split in ("train", "valid"):
        parts = []
        for w, src in sources:
            ids = split_documents(len(src), d.split)[split]
            if not len(ids):
                raise ConfigError("data.split", d.split, f"leaves no documents for the {split} split of "
                                  f"{src.name} ({len(src)} documents)")
            try:
                parts.append((w, MultimodalDataset(
                    src, ids, run.train.seq_length, run.train.seed, encode=encode, eod_id=eod_id,
                    media_tokens=tokens, processor=processor, on_bad_sample=d.on_bad_sample,
                    name=f"{src.name} ({split} split)", report=report)))
            except ValueError as e:
                if isinstance(e, ConfigError):
                    raise
                raise ConfigError("data.paths", src.name, str(e)) from None
        out.append(parts[0][1] if len(parts) == 1 else
                   BlendedDataset([p for _, p in parts], [w for w, _ in parts], name=f"{split} blend"))
    return out[0], out[1]
