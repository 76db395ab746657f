"""data=multimodal's embedded default: procedurally drawn images (coloured shapes, seven-segment digits) and short
videos (a shape moving across the frames) with captions that describe them, the same for every run (no download)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from PIL import Image, ImageDraw

from .documents import IMAGE_MARKER, VIDEO_MARKER

EMBEDDED_DOCUMENTS = 20000  # documents of the embedded default

__all__ = ["SyntheticDocuments", "draw", "EMBEDDED_DOCUMENTS"]


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
