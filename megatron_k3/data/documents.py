"""Image-text documents as JSON lines, one document per line (paths relative to the JSONL file):

    {"text": "A photo: <image> and a clip <video> ...", "images": ["a.png"], "videos": [["f0.png", "f1.png"]]}

Every `<image>` marker takes the next entry of "images", every `<video>` the next entry of "videos" (a list of frame
files of one size). `JsonlDocuments` reads them on demand; a document source (this, or drawings.SyntheticDocuments)
has len(), where(i), document(i) -> (text, images, videos), size(handle) and load(handle)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from PIL import Image

from ..errors import BadDocument

IMAGE_MARKER, VIDEO_MARKER = "<image>", "<video>"
_MARKERS = re.compile(r"(<image>|<video>)")

__all__ = ["IMAGE_MARKER", "VIDEO_MARKER", "JsonlDocuments", "media_of"]


def media_of(text: str, images: list, videos: list) -> tuple:
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
