"""Pixel preprocessing of data=multimodal, as the released K3 / K2.5 processor: RGB; scaled down (bicubic, keeping
the aspect) over `data.image_max_patches` patches or `data.image_max_side_patches` on a side; padded with black at
the bottom and right to a multiple of patch size x merge kernel; `(x / 255 - 0.5) / 0.5`; patchified to
[t * (H/ps) * (W/ps), 3, ps, ps] in (frame, patch row, patch column) order with grid (t, H/ps, W/ps); videos cut
into chunks of model.vision.pos_emb_time frames."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ..errors import BadDocument

__all__ = ["MediaProcessor"]


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
