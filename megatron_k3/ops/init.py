"""Initial values as a function of (seed, parameter name, global element index): the same weights whatever the
layout, and each rank computes only the part it holds.

Legend: S the full (unsharded) shape of a parameter, t its tile shape, o the offsets of a rank's block in S.

The full tensor is cut into fixed tiles (`tile_shape(S)`: at most 16384 elements, a power of two along each
dimension that divides it). Tile j of parameter `name` is drawn from its own generator, seeded with a 64-bit hash
of (seed, name, j), as `tile.numel()` values in row-major order (tiles at the edge of S are smaller, the same for
every layout). A rank generates the tiles its block [o, o + shape) intersects and keeps the intersection, so the
value of element i of parameter `name` does not depend on which rank holds it, how the tensor is split, or the
device: tensor parallelism (dimension 0 or 1), expert parallelism (dimension 0) and pipeline stages all read the
same numbers. Along dimensions 0 and 1 a tile spans at most a quarter of the dimension (128 elements at most), so
a split into up to 4 parts (128-aligned parts at full size) falls on tile boundaries and a rank never draws a tensor
as large as the full parameter it holds a part of; the cost is proportional to the rank's block.

Distributions (`Init`): normal(mean, std), uniform(low, high), constants, and an optional elementwise map of the
draws (the KDA decay and time-step parameters); draws are fp32, then cast to the parameter's dtype.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Init", "normal", "uniform", "constant", "tile_shape", "fill_", "draw"]

TILE_ELEMENTS = 16384
TILE_EDGE = 128
_M64 = (1 << 64) - 1


@dataclass(frozen=True)
class Init:
    """One parameter's initial distribution: kind "normal" (a = mean, b = std), "uniform" (a = low, b = high) or
    "constant" (a = the value); `then` maps the fp32 draws elementwise (None: identity)."""
    kind: str
    a: float = 0.0
    b: float = 1.0
    then: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self):
        if self.kind not in ("normal", "uniform", "constant"):
            raise ValueError(f"Init kind {self.kind!r}; valid: normal, uniform, constant")


def normal(std: float, mean: float = 0.0) -> Init:
    return Init("normal", mean, std)


def uniform(low: float, high: float, then=None) -> Init:
    return Init("uniform", low, high, then)


def constant(value: float) -> Init:
    return Init("constant", value)


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n (at least 1)."""
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def tile_shape(full: tuple) -> tuple:
    """The tile of a tensor of full shape `full`, from the last dimension to the first within a budget of
    TILE_ELEMENTS: dimensions 0 and 1 (where tensor and expert parallelism split) a power of two <= TILE_EDGE and <=
    a quarter of the dimension that divides it; later dimensions whole up to TILE_EDGE, else a power of two <=
    TILE_EDGE dividing them."""
    t = [1] * len(full)
    budget = TILE_ELEMENTS
    for d in reversed(range(len(full))):
        s = int(full[d])
        cap = min(TILE_EDGE, budget)
        if d >= 2 and s <= cap:
            t[d] = max(s, 1)
        else:
            t[d] = _pow2_divisor(s, cap if d >= 2 else min(cap, max(1, s // 4)))
        budget = max(1, budget // t[d])
    return tuple(t)


def _key(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{int(seed)}\x00{name}".encode(), digest_size=8).digest(), "little")


def _tile_seed(key: int, index: int) -> int:
    """splitmix64 of the parameter key and the tile's row-major index in the tile grid."""
    z = (key + (index + 1) * 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _draw(init: Init, buf: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if init.kind == "normal":
        buf.normal_(init.a, init.b, generator=gen)
    else:
        buf.uniform_(init.a, init.b, generator=gen)
    return init.then(buf) if init.then is not None else buf


def _window(t: torch.Tensor, start, size) -> torch.Tensor:
    """The box [start, start + size) of t as one view."""
    return t.as_strided(size, t.stride(), t.storage_offset() + sum(a * st for a, st in zip(start, t.stride())))


@torch.no_grad()
def fill_(local: torch.Tensor, init: Init, seed: int, name: str, full: tuple | None = None,
          offsets: tuple | None = None) -> torch.Tensor:
    """Write into `local` its block of parameter `name` (full shape `full`, default local's own; the block starts at
    `offsets` in it, default the origin) as initialised from `seed`; returns `local`. Tiles are drawn on the CPU and
    copied to local's device and dtype."""
    full = tuple(local.shape) if full is None else tuple(int(s) for s in full)
    offsets = (0,) * local.dim() if offsets is None else tuple(int(o) for o in offsets)
    shape = tuple(local.shape)
    if len(full) != len(shape) or len(offsets) != len(shape) or any(
            o < 0 or o + n > f for o, n, f in zip(offsets, shape, full)):
        raise ValueError(f"{name}: block {shape} at {offsets} does not lie in the full shape {full}")
    if init.kind == "constant":
        return local.fill_(init.a)
    if local.numel() == 0:
        return local
    if local.device.type != "cpu":  # one copy per parameter, not one per tile
        return local.copy_(fill_(torch.empty(shape, dtype=torch.float32), init, seed, name, full, offsets))
    tile = tile_shape(full)
    grid = [-(-f // t) for f, t in zip(full, tile)]
    key = _key(seed, name)
    gen = torch.Generator()
    buffers = {}  # one fp32 buffer per tile shape (edge tiles are smaller)
    ranges = [range(o // t, -(-(o + n) // t)) for o, n, t in zip(offsets, shape, tile)]
    for coords in itertools.product(*ranges):
        lo = [c * t for c, t in zip(coords, tile)]
        size = [min(a + t, f) - a for a, t, f in zip(lo, tile, full)]
        index = 0
        for c, g in zip(coords, grid):
            index = index * g + c
        gen.manual_seed(_tile_seed(key, index))
        key_shape = tuple(size)
        if key_shape not in buffers:
            buffers[key_shape] = torch.empty(key_shape, dtype=torch.float32)
        values = _draw(init, buffers[key_shape], gen)
        # the intersection of the tile [lo, lo + size) with the block [offsets, offsets + shape)
        a = [max(x, o) for x, o in zip(lo, offsets)]
        n = [min(x + m, o + k) - y for x, m, o, k, y in zip(lo, size, offsets, shape, a)]
        if n != size:
            values = _window(values, [y - x for y, x in zip(a, lo)], n)
        _window(local, [y - o for y, o in zip(a, offsets)], n).copy_(values)
    return local


def draw(init: Init, seed: int, name: str, full: tuple, offsets: tuple | None = None,
         shape: tuple | None = None) -> torch.Tensor:
    """The fp32 block of shape `shape` (default: the whole tensor) at `offsets` of parameter `name`, on the CPU."""
    shape = tuple(full) if shape is None else tuple(shape)
    return fill_(torch.empty(shape, dtype=torch.float32), init, seed, name, full, offsets)
