"""The sharded checkpoint format (format 3): every rank writes the pieces of the global tensors it owns, with no
gather; any rank of any layout reads back exactly the regions it needs.

A checkpoint directory holds, besides meta.json and rng.pt:

    rank_00000.safetensors   the pieces rank 0 wrote (fp32 master weights, optimizer states, buffers), one
                             safetensors entry per piece
    rank_00000.json          what each entry is: {entry: [tensor, offsets, sizes]} and {tensor: [global shape,
                             dtype]}; written after its safetensors file is complete and fsynced (a rank's "done")
    index.json               every rank's entries merged by rank 0 at commit: {tensor: {shape, dtype, chunks:
                             [[file, entry, offsets, sizes], ...]}}, each tensor's chunks checked to tile it

A piece is a box of the global tensor (offsets and sizes per dimension). What a rank owns is in general a contiguous
range of its shard's flattened elements (a ZeRO partition, or a share of a replicated tensor split among its
replicas), which `flat_range_boxes` cuts into at most 2 * ndim - 1 boxes. Reading a region opens only the files
whose boxes overlap it and reads only the overlaps (`safe_open(...).get_slice`), so a rank of another layout reads
what it needs and no more.

Why not torch.distributed.checkpoint: its FileSystemWriter pickles each item (torch.save) and its reader loads a
stored item whole and then narrows it (a rank loading a tenth of a tensor reads all of it); ZeRO's flat partitions
are not DTensors, so it would need a custom planner anyway; and its async save runs collectives from a background
thread. Here the files are safetensors (nothing pickled), reads are exact slices, and an async save needs no
collective after it starts (rank 0 commits when every rank's `rank_XXXXX.json` is there).
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

INDEX = "index.json"
BUFFER_BYTES = 64 << 20  # device -> host copies of one piece go through slices of at most this size
MAX_OPEN = 32  # rank files a reader keeps open at once

_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
_DTYPE_NAME = {d: str(d).replace("torch.", "") for d in _ST_DTYPE}
_BY_NAME = {v: k for k, v in _DTYPE_NAME.items()}


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated, corrupted or unsafe; the message names the file."""


def fsync(path: Path) -> None:
    """Flush a file, or a directory's entries (a rename into it), to the disk. A directory that cannot be opened
    for it (some filesystems) is left to the filesystem's own ordering."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if Path(path).is_dir():
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not Path(path).is_dir():
            raise
    finally:
        os.close(fd)


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def rank_index(rank: int) -> str:
    return f"rank_{rank:05d}.json"


# ------------------------------------------------------------------------------------------------ boxes
def flat_range_boxes(shape, start: int, numel: int) -> list:
    """[(offsets, sizes, position)] boxes that together are the elements [start, start + numel) of a row-major
    tensor of `shape`; `position` is where a box's elements begin within the range. Boxes come in order, each
    one's elements contiguous in the flattened tensor: at most a partial head, a run of whole slices and a
    partial tail per dimension."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        return [((), (), 0)] if numel else []
    out = []

    def rec(dim, prefix, lo, hi, pos):  # elements [lo, hi) of the sub-tensor shape[dim:] at fixed `prefix`
        inner = math.prod(shape[dim + 1:])
        a, b = -(-lo // inner) * inner, (hi // inner) * inner  # the whole slices are [a, b)
        if a > b:  # inside one slice
            rec(dim + 1, prefix + (lo // inner,), lo % inner, hi - lo // inner * inner, pos)
            return
        if lo < a:
            rec(dim + 1, prefix + (lo // inner,), lo % inner, inner, pos)
            pos += a - lo
        if a < b:
            out.append((prefix + (a // inner,) + (0,) * (len(shape) - dim - 1),
                        (1,) * len(prefix) + ((b - a) // inner,) + shape[dim + 1:], pos))
            pos += b - a
        if b < hi:
            rec(dim + 1, prefix + (b // inner,), 0, hi - b, pos)

    if numel:
        rec(0, (), start, start + numel, 0)
    return out


def share(numel: int, parts: int, index: int) -> tuple:
    """(start, numel) of share `index` of `parts` near-equal contiguous shares of `numel` elements."""
    lo, hi = numel * index // parts, numel * (index + 1) // parts
    return lo, hi - lo


# ------------------------------------------------------------------------------------------------ writing
class RankPieces:
    """The pieces one rank writes: `add(tensor_name, global_shape, offsets, sizes, data)`."""

    def __init__(self):
        self.entries = []  # (entry key, tensor, offsets, sizes, data)
        self.shapes = {}  # tensor -> (global shape, dtype name)

    def add(self, name: str, global_shape, offsets, sizes, data: torch.Tensor) -> None:
        global_shape, offsets, sizes = tuple(map(int, global_shape)), tuple(map(int, offsets)), tuple(map(int, sizes))
        if tuple(data.shape) != sizes:
            raise ValueError(f"{name}: piece data {tuple(data.shape)} is not the box {sizes}")
        if any(o < 0 or o + s > g for o, s, g in zip(offsets, sizes, global_shape)) or len(offsets) != len(sizes):
            raise ValueError(f"{name}: box at {offsets} of {sizes} is outside {global_shape}")
        if data.numel() == 0:
            return
        self.shapes[name] = (global_shape, _DTYPE_NAME[data.dtype])
        self.entries.append((f"{name}@{'_'.join(map(str, offsets))}", name, offsets, sizes, data))

    def add_range(self, name: str, local, global_shape, shard_offsets, start: int, flat) -> None:
        """The elements [start, start + flat.numel()) of a local shard shaped `local` (placed at `shard_offsets`
        in the global tensor), given flat (a 1-D tensor of those elements), as boxes."""
        for off, sizes, pos in flat_range_boxes(local, start, flat.numel()):
            n = math.prod(sizes)
            self.add(name, global_shape, tuple(a + b for a, b in zip(shard_offsets, off)), sizes,
                     flat.narrow(0, pos, n).view(sizes))

    @property
    def nbytes(self) -> int:
        return sum(e[4].numel() * e[4].element_size() for e in self.entries)

    def snapshot(self) -> "RankPieces":
        """A copy on the host of every piece (what an async save writes while training goes on)."""
        out = RankPieces()
        out.shapes = dict(self.shapes)
        out.entries = [(k, n, o, s, _host_copy(d)) for k, n, o, s, d in self.entries]
        if any(d.is_cuda for *_, d in self.entries):
            torch.cuda.synchronize()  # the pinned copies were issued asynchronously
        return out

    def write(self, directory: Path, rank: int) -> None:
        """rank_XXXXX.safetensors (streamed: no copy of the pieces beyond one BUFFER_BYTES slice for a device
        tensor), then rank_XXXXX.json, each fsynced; the json goes in by rename, so it marks a complete file."""
        directory = Path(directory)
        header, pos = {}, 0
        for key, _, _, sizes, data in self.entries:
            nb = data.numel() * data.element_size()
            header[key] = {"dtype": _ST_DTYPE[data.dtype], "shape": list(sizes), "data_offsets": [pos, pos + nb]}
            pos += nb
        header["__metadata__"] = {"format": "pt", "rank": str(rank)}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        path = directory / rank_file(rank)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for _, _, _, _, data in self.entries:
                _write_bytes(f, data)
        fsync(path)
        index = {"rank": rank, "file": rank_file(rank),
                 "entries": {k: [n, list(o), list(s)] for k, n, o, s, _ in self.entries},
                 "tensors": {n: [list(g), d] for n, (g, d) in self.shapes.items()}}
        tmp = directory / f".{rank_index(rank)}.tmp"
        tmp.write_text(json.dumps(index))
        fsync(tmp)
        os.replace(tmp, directory / rank_index(rank))


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy in host memory; of a device tensor into pinned memory (copied asynchronously: synchronise after)."""
    t = t.detach()
    if not t.is_cuda:
        return t.to("cpu", copy=True)
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def _write_bytes(f, data: torch.Tensor) -> None:
    flat = data.detach().contiguous().reshape(-1)
    step = max(1, BUFFER_BYTES // max(1, flat.element_size()))
    for lo in range(0, flat.numel(), step):
        part = flat[lo:lo + step]
        if part.device.type != "cpu":
            part = part.to("cpu")
        f.write(_as_bytes(part))


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (numpy has no bfloat16: reinterpret those)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    elif t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


def wait_for_ranks(directory: Path, world: int, timeout: float, poll: float = 0.05) -> None:
    """Until every rank's rank_XXXXX.json is in `directory` (an async save: the ranks finish at their own pace);
    a rank that failed leaves rank_XXXXX.error, which is raised at once."""
    directory = Path(directory)
    deadline = time.monotonic() + timeout
    while True:
        errors = sorted(directory.glob("rank_*.error"))
        if errors:
            raise CheckpointError(f"{errors[0]}: {errors[0].read_text().strip()}")
        missing = [r for r in range(world) if not (directory / rank_index(r)).is_file()]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise CheckpointError(f"{directory}: ranks {missing[:8]} did not finish writing within "
                                       f"{timeout:.0f} s; the checkpoint is not committed")
        time.sleep(poll)


def merge_index(directory: Path, world: int) -> dict:
    """index.json from every rank's rank_XXXXX.json; checks that each tensor's chunks tile it exactly (their volumes
    sum to its size and each lies inside it), so a layout that wrote an element twice or not at all never commits."""
    directory = Path(directory)
    tensors = {}
    for r in range(world):
        part = json.loads((directory / rank_index(r)).read_text())
        for name, (shape, dtype) in part["tensors"].items():
            t = tensors.setdefault(name, {"shape": shape, "dtype": dtype, "chunks": []})
            if t["shape"] != shape or t["dtype"] != dtype:
                raise CheckpointError(f"{directory / rank_index(r)}: {name} is {shape} {dtype} there, "
                                           f"{t['shape']} {t['dtype']} on another rank")
        for key, (name, offsets, sizes) in part["entries"].items():
            tensors[name]["chunks"].append([part["file"], key, offsets, sizes])
    for name, t in tensors.items():
        covered = sum(math.prod(c[3]) for c in t["chunks"])
        overlap = _first_overlap(t["chunks"])
        if covered != math.prod(t["shape"]) or overlap:
            what = (f"boxes at {overlap[0]} and {overlap[1]} overlap" if overlap else
                    f"the ranks wrote {covered} of its {math.prod(t['shape'])} elements")
            raise CheckpointError(f"{directory}: {name} {t['shape']}: {what} (a layout bug: some elements written "
                                  f"twice or not at all); the checkpoint is not committed")
        t["chunks"].sort(key=lambda c: c[2])
    index = {"tensors": dict(sorted(tensors.items()))}
    tmp = directory / f".{INDEX}.tmp"
    tmp.write_text(json.dumps(index))
    fsync(tmp)
    os.replace(tmp, directory / INDEX)
    return index


def _first_overlap(chunks: list):
    """The offsets of two boxes of `chunks` ([file, entry, offsets, sizes]) that share an element, or None: a sweep
    along dimension 0, each box compared with the earlier ones whose rows it reaches."""
    boxes = sorted((tuple(c[2]), tuple(c[3])) for c in chunks)
    active = []  # (end along dim 0, offsets, sizes)
    for off, size in boxes:
        if not off:  # a 0-dim tensor: one box
            if active:
                return active[0][1], off
            active.append((1, off, size))
            continue
        active = [a for a in active if a[0] > off[0]]
        for _, o, z in active:
            if all(a < b + y and b < a + x for a, x, b, y in zip(off, size, o, z)):
                return o, off
        active.append((off[0] + size[0], off, size))
    return None


# ------------------------------------------------------------------------------------------------ reading
class ShardIndex:
    """The tensors of a format-3 checkpoint, read by region: `read(name, offsets, out)` fills `out` with the box of
    tensor `name` at `offsets` (sized like `out`), opening only the files that hold part of it. Every problem
    names the file: a missing or truncated rank file, an index naming an absent file or entry."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        f = self.path / INDEX
        if not f.is_file():
            raise CheckpointError(f"{f}: missing")
        try:
            self.tensors = json.loads(f.read_text())["tensors"]
        except (ValueError, KeyError, OSError) as e:
            raise CheckpointError(f"{f}: unreadable ({e})") from None
        self._open = OrderedDict()  # the files open now, least recently used first (at most MAX_OPEN)
        self.bytes_read = 0  # what this reader has read: the overlaps of the regions asked for

    @property
    def total_bytes(self) -> int:
        return sum(math.prod(t["shape"]) * _BY_NAME[t["dtype"]].itemsize for t in self.tensors.values())

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list:
        return list(self.tensors)

    def shape(self, name: str) -> tuple:
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return _BY_NAME[self.tensors[name]["dtype"]]

    def _file(self, name: str):
        h = self._open.get(name)
        if h is not None:
            self._open.move_to_end(name)
        else:
            p = self.path / name
            if not p.is_file():
                raise CheckpointError(f"{p}: missing ({INDEX} places tensors there)")
            try:
                h = safe_open(str(p), framework="pt", device="cpu")
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{p}: not a readable safetensors file ({e}); truncated or "
                                           f"corrupted?") from None
            self._open[name] = h
            while len(self._open) > MAX_OPEN:  # the file handles and the mapped pages a reader keeps stay bounded
                self._open.popitem(last=False)
        return h

    @torch.no_grad()
    def read(self, name: str, offsets, out: torch.Tensor) -> torch.Tensor:
        """out <- the box of `name` at `offsets` sized like out (cast to out's dtype); returns out."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.path / INDEX}: no tensor {name}")
        offsets, sizes = tuple(offsets), tuple(out.shape)
        filled = 0
        for file, key, c_off, c_size in self.tensors[name]["chunks"]:
            lo = [max(a, b) for a, b in zip(offsets, c_off)]
            hi = [min(a + s, b + t) for a, s, b, t in zip(offsets, sizes, c_off, c_size)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            h = self._file(file)
            try:
                sl = h.get_slice(key)
                part = sl[tuple(slice(a - b, e - b) for a, e, b in zip(lo, hi, c_off))]
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{self.path / file}: {name} (entry {key}) unreadable ({e}); "
                                           f"truncated or corrupted?") from None
            if tuple(part.shape) != tuple(h_ - l_ for l_, h_ in zip(lo, hi)):
                raise CheckpointError(f"{self.path / file}: {name} entry {key} holds {tuple(sl.get_shape())},"
                                           f" {INDEX} says {c_size}")
            dst = out
            for d, (a, e) in enumerate(zip(lo, hi)):
                dst = dst.narrow(d, a - offsets[d], e - a)
            dst.copy_(part)
            filled += part.numel()
            self.bytes_read += part.numel() * part.element_size()
        if filled != out.numel():
            raise CheckpointError(f"{self.path / INDEX}: {name} box at {offsets} of {sizes}: its chunks cover "
                                       f"{filled} of {out.numel()} elements")
        return out

    def read_range(self, name: str, local, shard_offsets, start: int, flat: torch.Tensor) -> None:
        """flat <- the elements [start, start + flat.numel()) of a local shard shaped `local` placed at
        `shard_offsets` in the global tensor (the reading side of RankPieces.add_range)."""
        for off, sizes, pos in flat_range_boxes(local, start, flat.numel()):
            self.read(name, tuple(a + b for a, b in zip(shard_offsets, off)),
                      flat.narrow(0, pos, math.prod(sizes)).view(sizes))

    def read_full(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        shape = self.shape(name)
        return self.read(name, (0,) * len(shape), torch.empty(shape, dtype=dtype or self.dtype(name)))

    def close(self) -> None:
        self._open.clear()
