"""Streaming, sharded import and export of Hugging Face directories (the Kimi K3 and Kimi Linear layouts): every
rank of any layout (tensor parallel, expert parallel, a pipeline stage, replicas) reads and writes only its part.

`load_hf_sharded(model, path)` fills a built K3ForCausalLM (or K3ForConditionalGeneration) in place (sharded or not;
built on the meta device it is allocated first, uninitialised). From `model.safetensors.index.json` each rank finds
the shard files that hold its tensors, opens only those with `safetensors.safe_open` (a memory map) and reads with
`get_slice` only its slice: its rows or columns along its tensor-parallel dimension, its heads of A_log (stored
zero-padded to a multiple of 128 heads), and of the routed experts only its expert-parallel block, dequantising from
MXFP4 only those. The vision tower's tensors (`vision_tower.`, `mm_projector.`) are read by the rank parts that hold
the tower (with the embedding); a text-only model skips them, with one log line counting them. Nothing is copied
into the model before every rank has checked its part: the config against config.json, the index against the config
(every tensor present, none unknown), each shard file it needs (present, readable, complete) and the shape and dtype
of each tensor it reads; the first failure (in rank order) is raised on every rank, as one line `<file>: <tensor>:
<what>`. A file is re-opened after READ_BUDGET bytes were read from it, so the pages a rank touched in a memory map
(they count towards its resident memory) stay bounded.

`save_hf_sharded(model, path, tp_group=...)` writes the directory that `save_hf` writes for the unsharded model,
tensor for tensor, from the ranks' parts. A checkpoint tensor has one writer, the lowest global rank that holds it
whole: the non-expert tensors of a pipeline stage are written by the stage's lowest rank at tensor-parallel rank 0,
which gathers the tensor-parallel shards from its own tensor-parallel group only (one tensor at a time); a block of
routed experts (not split by tensor parallelism) by the lowest rank holding it, which quantises only that block.
Each writer packs its tensors into files of at most `max_shard_size` bytes; the file names are numbered over all
writers (`model-0000i-of-0000n.safetensors`) from the file counts every rank shares first; after every rank wrote,
rank 0 writes `model.safetensors.index.json` and config.json. A failed write is raised on every rank and leaves no
index.

Kimi Linear directories are read in the checkpoint naming (per-expert `.weight`, separate conv filters, also the
dense MLP under `block_sparse_moe.` that transformers writes); transformers' in-memory naming (fused
`conv1d.weight` / `experts.gate_up_proj`) is not sliced: `load_hf` reads such a directory whole.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from ..annotations import full_shape, meta, shard_offsets
from ..errors import one_line
from ..model.experts import GroupedExperts
from ..parallel.agree import gather
from . import k3_layout, kimi_linear
from .directory import (
    CONFIG,
    DEFAULT_MAX_SHARD_SIZE,
    INDEX,
    LAYOUTS,
    SINGLE,
    ConfigMismatchError,
    _dtype,
    _dtype_name,
    _own_storage,
    config_differences,
    config_from_hf,
    detect_layout,
)
from .k3_experts import BLOCK, dequantize_k3_weight, export_scale_mode, quantize_k3_weight, remember_scales

log = logging.getLogger(__name__)

READ_BUDGET = 256 << 20  # bytes read from one memory map before it is closed and re-opened
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(w[123])")

__all__ = ["load_hf_sharded", "save_hf_sharded", "LoadReport", "CheckpointReadError", "MissingShardError",
           "CheckpointWriteError", "checkpoint_keys", "READ_BUDGET"]


class CheckpointReadError(ValueError):
    """A Hugging Face directory that does not hold what its config says, or cannot be read: one line,
    `<file>: <tensor>: <what>`."""


class MissingShardError(CheckpointReadError, FileNotFoundError):
    """A file the directory needs (config.json, the index, a shard file the index names) is not there."""


class CheckpointWriteError(OSError):
    """A shard file, the index or config.json that could not be written: one line, `<file>: <tensor>: <what>`."""


@dataclass
class LoadReport:
    """What one rank's `load_hf_sharded` did."""
    layout: str
    files: list = field(default_factory=list)  # the shard files this rank opened (names within the directory)
    tensors: int = 0  # checkpoint tensors read (a packed expert matrix and its scales count as two)
    bytes_read: int = 0  # bytes of the slices read
    skipped: int = 0  # vision-tower tensors in the directory, not read


# ------------------------------------------------------------------------------------------------ collectives
def _resolve_group(group):
    """"auto": the default process group when torch.distributed is initialised, else none (this process alone)."""
    if group == "auto":
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return group


def _world(group) -> tuple:
    return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)


def _gather(obj, group) -> list:
    """Every rank's `obj` in `group` (None: this process alone)."""
    return gather(obj, group) if group is not None else [obj]


def _agree(err: BaseException | None, group, extra=None, other=CheckpointReadError) -> list:
    """Every rank's `extra`; raises, on every rank, the first rank's error (this rank's own exception where it is
    that one, else `other`, or MissingShardError for a missing file, with its message)."""
    payload = (None if err is None else (str(err), isinstance(err, FileNotFoundError)), extra)
    out = _gather(payload, group)
    first = next((e for e, _ in out if e is not None), None)
    if first is not None:
        message, missing = first
        if err is not None and str(err) == message:
            raise err
        raise (MissingShardError if missing and other is CheckpointReadError else other)(message)
    return [x for _, x in out]


# ------------------------------------------------------------------------------------------------ the index
def _index(path: Path) -> tuple:
    """({tensor name: file name}, the file that lists them) of a directory."""
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointReadError(f"{path / INDEX}: weight_map: not a safetensors index ({e})") from None
        return weight_map, path / INDEX
    if (path / SINGLE).is_file():
        try:
            with safe_open(str(path / SINGLE), framework="pt") as f:
                return dict.fromkeys(f.keys(), SINGLE), path / SINGLE
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
            raise CheckpointReadError(f"{path / SINGLE}: (header): cannot be read ({one_line(e)})") from None
    raise MissingShardError(f"{path}: neither {SINGLE} nor {INDEX} (only safetensors checkpoints are read)")


def checkpoint_keys(path) -> dict:
    """{tensor name: shard file} of a Hugging Face directory (from its index, or its single file's header)."""
    return _index(Path(path))[0]


# ------------------------------------------------------------------------------------------------ where tensors lie
@dataclass(frozen=True)
class _Source:
    """Where one of our tensors lies in checkpoint tensor `key` of shape `shape`: our dimension i runs along the
    checkpoint's dimension dims[i] (its other dimensions have size 1); `padding`: a region that must hold zeros."""
    key: str
    shape: tuple
    dims: tuple
    padding: tuple | None = None

    def region(self, start, size) -> tuple:
        idx = [slice(0, 1)] * len(self.shape)
        for i, c in enumerate(self.dims):
            idx[c] = slice(start[i], start[i] + size[i])
        return tuple(idx)


def _source(key: str, kind: str, shape: tuple) -> _Source:
    """kind "same": our shape; "padded_heads": K3's A_log, [H] zero-padded to [Hp]; "heads_4d": Kimi Linear's
    A_log [1, 1, H, 1]."""
    if kind == "padded_heads":
        h, hp = shape[0], k3_layout.padded_heads(shape[0])
        return _Source(key, (hp,), (0,), (slice(h, hp),))
    if kind == "heads_4d":
        return _Source(key, (1, 1, shape[0], 1), (2,))
    return _Source(key, tuple(shape), tuple(range(len(shape))))


class _Names:
    """Our state-dict names -> checkpoint names of one directory, for one config and layout, from the layout
    modules' pair lists (k3_layout._pairs, kimi_linear._pairs). `present`: the directory's tensor names."""

    def __init__(self, cfg, layout: str, present, where: Path):
        self.cfg, self.layout, self.where = cfg, layout, where
        self.actual, self.skipped = {}, 0  # {name without the K3 prefix: name in the directory}
        self.prefixed = layout == "k3" and any(k.startswith(k3_layout.PREFIX) for k in present)
        vision = layout == "k3" and cfg.vision.enabled
        for k in present:
            if k.startswith(k3_layout.FOREIGN_PREFIXES) and not vision:
                self.skipped += 1
            elif layout == "k3" and k.startswith(k3_layout.PREFIX):
                self.actual[k[len(k3_layout.PREFIX):]] = k
            else:
                self.actual.setdefault(k, k)
        if layout == "kimi_linear" and kimi_linear._is_runtime_naming(self.actual):
            raise CheckpointReadError(f"{where}: (naming): transformers' in-memory naming (fused conv1d.weight / "
                                      "experts.gate_up_proj) is not read in slices; load_hf reads it whole")
        self.plain = {}  # our name -> (checkpoint name, kind)
        if layout == "k3":
            for ours, key, _, _ in k3_layout._pairs(cfg):
                self.plain[ours] = (key, "padded_heads" if ours.endswith(".A_log") else "same")
            layers = k3_layout._moe_layers(cfg)
        else:
            for ours, key, _, _ in kimi_linear._pairs(cfg):
                quirk = re.sub(r"\.mlp\.(gate_proj|up_proj|down_proj)\.", r".block_sparse_moe.\1.", key)
                if key not in self.actual and quirk != key and quirk in self.actual:
                    key = quirk  # transformers 5.x writes a dense layer's MLP under block_sparse_moe.
                self.plain[ours] = (key, "heads_4d" if ours.endswith(".A_log") else "same")
            layers = kimi_linear._moe_layers(cfg)
        self.experts = {}  # layer -> (checkpoint prefix, "mxfp4" or "dense")
        for i in layers:
            prefix = f"model.layers.{i}.block_sparse_moe.experts"
            dense = layout == "kimi_linear" or f"{prefix}.0.w1.weight" in self.actual
            self.experts[i] = (prefix, "dense" if dense else "mxfp4")

    def expert_keys(self, i: int, e: int, n: str) -> dict:
        """{part: checkpoint name} of expert e's matrix n in layer i: "weight", or "packed" and "scale"."""
        prefix, form = self.experts[i]
        if form == "dense":
            return {"weight": f"{prefix}.{e}.{n}.weight"}
        return {"packed": f"{prefix}.{e}.{n}.weight_packed", "scale": f"{prefix}.{e}.{n}.weight_scale"}

    def name(self, key: str) -> str:
        """The name of `key` in the directory (with the K3 prefix where the directory uses it)."""
        if key in self.actual:
            return self.actual[key]
        return k3_layout.checkpoint_name(key) if self.prefixed else key

    def check_complete(self):
        """Every tensor the config implies is in the directory, and nothing else (but the vision tower)."""
        expected = {key for key, _ in self.plain.values()}
        for i in self.experts:
            for e in range(self.cfg.num_experts):
                for n in ("w1", "w2", "w3"):
                    expected.update(self.expert_keys(i, e, n).values())
        missing = sorted(k for k in expected if k not in self.actual)
        if missing:
            raise CheckpointReadError(f"{self.where}: {self.name(missing[0])}: missing ({len(missing)} tensor(s) the "
                                      f"config implies are not in the directory)")
        unknown = sorted(set(self.actual) - expected)
        if unknown:
            raise CheckpointReadError(f"{self.where}: {self.actual[unknown[0]]}: not a tensor of this config "
                                      f"({self.layout} layout; {len(unknown)} such tensor(s))")


# ------------------------------------------------------------------------------------------------ import
@dataclass
class _Read:
    key: str  # name in the directory
    shape: tuple  # its shape as the config implies
    region: tuple  # the slice this rank reads
    apply: object  # apply(view): consume the slice while its file is open
    u8: bool = False  # a packed MXFP4 part: stored as U8
    padding: tuple | None = None


def _targets(model):
    """(name, tensor) of every distinct parameter and persistent buffer of the model, in state-dict order."""
    seen = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            yield name, t


def _plan_reads(model, names: _Names) -> list:
    """This rank's reads: one per plain tensor (its slice), one or two per local expert matrix."""
    reads, pending = [], {}

    def copy_into(dst):
        def apply(view):
            dst.copy_(view.reshape(dst.shape))
        return apply

    for name, t in _targets(model):
        start, size, shape = shard_offsets(t), tuple(t.shape), full_shape(t)
        m = _EXPERT.fullmatch(name)
        if m:
            i, n = int(m.group(1)), m.group(2)
            if i not in names.experts:
                raise CheckpointReadError(f"{names.where}: {name}: an expert weight of layer {i}, which the config "
                                          "makes dense")
            o, k = shape[1:]
            owner = model.get_submodule(name.rsplit(".", 1)[0])  # the GroupedExperts (kept MXFP4 scales)
            for el in range(size[0]):
                e = start[0] + el
                dst = t[el]
                keys = names.expert_keys(i, e, n)
                if "weight" in keys:
                    src = _source(names.name(keys["weight"]), "same", (o, k))
                    reads.append(_Read(src.key, src.shape, src.region(start[1:], size[1:]), copy_into(dst)))
                    continue
                if k % BLOCK:
                    raise CheckpointReadError(f"{names.where}: {names.name(keys['packed'])}: the input width {k} is "
                                              f"not a multiple of the MXFP4 block {BLOCK}")
                slot = (name, el)

                def part(kind, dst=dst, slot=slot, start=start, size=size, owner=owner, n=n, el=el, whole=(o, k)):
                    def apply(view):
                        got = pending.setdefault(slot, {})
                        got[kind] = view  # a view of the memory map, kept alive until its partner is read
                        if len(got) == 2:
                            del pending[slot]
                            w = dequantize_k3_weight(got["packed"], got["scale"], dst.dtype)
                            dst.copy_(w[tuple(slice(s, s + z) for s, z in zip(start[1:], size[1:]))])
                            if tuple(size[1:]) == whole:  # the whole matrix: its encoding is kept for export
                                remember_scales(owner, n, el, got["scale"])
                    return apply

                for kind, cols in (("packed", k // 2), ("scale", k // BLOCK)):
                    key = names.name(keys[kind])
                    reads.append(_Read(key, (o, cols), (slice(0, o), slice(0, cols)), part(kind), u8=True))
            continue
        if name not in names.plain:
            raise CheckpointReadError(f"{names.where}: {name}: our tensor has no {names.layout} name")
        key, kind = names.plain[name]
        src = _source(names.name(key), kind, shape)
        reads.append(_Read(src.key, src.shape, src.region(start, size), copy_into(t), padding=src.padding))
    return reads


def _open(file: Path, first_key: str):
    try:
        return safe_open(str(file), framework="pt")
    except FileNotFoundError:
        raise MissingShardError(f"{file}: {first_key}: the shard file is missing") from None
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt header: safetensors' own error type
        raise CheckpointReadError(f"{file}: {first_key}: cannot be read ({one_line(e)})") from None


def _check_file(file: Path, reads: list):
    """Open `file` and check every read of this rank against its header (and A_log's padding)."""
    f = _open(file, reads[0].key)
    try:
        keys = set(f.keys())
        for r in reads:
            if r.key not in keys:
                raise CheckpointReadError(f"{file}: {r.key}: not in the file, though {INDEX} places it there")
            sl = f.get_slice(r.key)
            shape = tuple(sl.get_shape())
            if shape != tuple(r.shape):
                raise CheckpointReadError(f"{file}: {r.key}: the file holds {list(shape)}, the config implies "
                                          f"{list(r.shape)}")
            if r.u8 and sl.get_dtype() != "U8":
                raise CheckpointReadError(f"{file}: {r.key}: MXFP4 parts are U8, the file holds {sl.get_dtype()}")
            if r.padding is not None:
                pad = sl[r.padding]
                if torch.count_nonzero(pad):
                    raise CheckpointReadError(f"{file}: {r.key}: per-head values zero-padded to {r.shape[0]} "
                                              f"expected; {int(torch.count_nonzero(pad))} padding value(s) are "
                                              "not zero")
    finally:
        del f


def _read_file(file: Path, reads: list, report: LoadReport):
    """Apply every read of `file`, re-opening its memory map after READ_BUDGET bytes."""
    f, touched = None, 0
    try:
        for r in reads:
            if f is None or touched > READ_BUDGET:
                f, touched = None, 0  # drop the old map (and the pages this rank touched in it) first
                f = _open(file, r.key)
            sl = f.get_slice(r.key)
            view = sl[r.region]
            with torch.no_grad():
                r.apply(view)
            touched += math.prod(r.shape) * view.element_size()  # column slices fault in the whole tensor
            report.bytes_read += view.numel() * view.element_size()
            report.tensors += 1
            del view, sl
    finally:
        del f


@torch.no_grad()
def load_hf_sharded(model, path, layout: str = "auto", group="auto", device=None) -> LoadReport:
    """Fill `model` (a K3ForCausalLM, or a rank's part of one: pipeline stage, tensor-parallel shards, a block of
    experts) in place from the Hugging Face directory `path`, reading only this rank's slices (module docstring).

    `model.cfg` must agree with config.json (else ConfigMismatchError). A model built on the meta device is first
    allocated on `device` (default cpu), uninitialised. `group`: the processes that load together, whose errors
    are raised on all of them ("auto": the default group when torch.distributed is initialised; None: this
    process alone). Call it on every rank of the group. Returns this rank's LoadReport."""
    path = Path(path)
    group = _resolve_group(group)
    rank, _ = _world(group)
    err, report, by_file = None, None, {}
    try:
        if not (path / CONFIG).is_file():
            raise MissingShardError(f"{path / CONFIG}: (config): no {CONFIG}")
        hf_config = json.loads((path / CONFIG).read_text())
        layout = detect_layout(hf_config) if layout == "auto" else layout
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
        diffs = config_differences(model.cfg, config_from_hf(hf_config, layout))
        if diffs:
            raise ConfigMismatchError(path, diffs)
        weight_map, where = _index(path)
        for file in sorted(set(weight_map.values())):
            if not (path / file).is_file():
                first = min(k for k, v in weight_map.items() if v == file)
                raise MissingShardError(f"{path / file}: {first}: the shard file is missing ({where.name} names it)")
        names = _Names(model.cfg, layout, weight_map, where)
        names.check_complete()
        if any(t.is_meta for _, t in _targets(model)):
            model.materialize(device or "cpu", init=False)
        for r in sorted(_plan_reads(model, names), key=lambda r: r.key):
            by_file.setdefault(weight_map[r.key], []).append(r)
        for file, reads in sorted(by_file.items()):
            _check_file(path / file, reads)
        report = LoadReport(layout, sorted(by_file), skipped=names.skipped)
    except Exception as e:  # noqa: BLE001 - agreed over the group, then raised on every rank
        err = e
    _agree(err, group)
    if report.skipped and rank == 0:
        log.info("%s: skipped %d vision-tower tensors (vision_tower., mm_projector.)", path, report.skipped)
    err = None
    try:
        for file, reads in sorted(by_file.items()):
            _read_file(path / file, reads, report)
    except Exception as e:  # noqa: BLE001
        err = e
    _agree(err, group)
    log.debug("%s: read %d tensors (%d bytes) from %d files", path, report.tensors, report.bytes_read,
              len(report.files))
    return report


# ------------------------------------------------------------------------------------------------ export
@dataclass(frozen=True)
class _Part:
    """What one rank holds: its pipeline stage, tensor-parallel and expert-parallel coordinates."""
    stage: tuple  # (layer indices, embedding held, LM head held)
    tp: tuple  # (rank, size)
    ep: tuple  # (rank, size)
    tp_members: tuple  # global ranks of its tensor-parallel group, in group order


def _describe(model, tp_group, rank: int) -> _Part:
    core = model.model
    stage = (tuple(core.layers.indices()), core.embed_tokens is not None, model.lm_head is not None)
    tp, ep = (0, 1), (0, 1)
    for _, t in _targets(model):
        m = meta(t)
        if m.tp_dim is not None:
            tp = (m.tp_rank, m.tp_size)
        if m.ep_size > 1:
            ep = (m.ep_rank, m.ep_size)
    members = (rank,)
    if tp[1] > 1:
        if tp_group is None:
            raise ValueError("save_hf_sharded: the model is split by tensor parallelism; pass tp_group=")
        members = tuple(dist.get_process_group_ranks(tp_group))
        if len(members) != tp[1] or members[tp[0]] != rank:
            raise ValueError(f"save_hf_sharded: tp_group {list(members)} is not this rank's tensor-parallel group "
                             f"(rank {tp[0]} of {tp[1]})")
    return _Part(stage, tp, ep, members)


def _check_cover(parts: list, cfg):
    layers = set().union(*(set(p.stage[0]) for p in parts))
    if layers != set(range(cfg.num_layers)) or not any(p.stage[1] for p in parts) or not any(p.stage[2] for p in
                                                                                           parts):
        raise ValueError(f"save_hf_sharded: the ranks hold layers {sorted(layers)} (embedding "
                         f"{any(p.stage[1] for p in parts)}, head {any(p.stage[2] for p in parts)}), not the whole "
                         f"model of {cfg.num_layers} layers")


@dataclass
class _Item:
    key: str
    nbytes: int
    produce: object  # () -> the tensor (gathering over tensor parallelism where needed)
    split: torch.Tensor | None = None  # the tensor-parallel shard this item gathers, if any


class _Gather:
    """A tensor-parallel-split tensor made whole on the writer: gathered over the writer's tensor-parallel group."""

    def __init__(self, tp_group, writer: int, is_writer: bool):
        self.group, self.writer, self.is_writer = tp_group, writer, is_writer

    def __call__(self, t: torch.Tensor) -> torch.Tensor | None:
        m = meta(t)
        local = t.detach().contiguous()
        if m.tp_dim is None:
            return local
        parts = [torch.empty_like(local) for _ in range(m.tp_size)] if self.is_writer else None
        dist.gather(local, parts, dst=self.writer, group=self.group)
        return torch.cat(parts, dim=m.tp_dim) if self.is_writer else None


def _plain_rules(cfg, layout: str) -> dict:
    """{our name: (checkpoint name without the K3 prefix, ours -> checkpoint)}."""
    pairs = k3_layout._pairs(cfg) if layout == "k3" else kimi_linear._pairs(cfg)
    return {ours: (key, fwd) for ours, key, fwd, _ in pairs}


def _out_dtype(layout: str, key: str, t_dtype, dt):
    """The dtype `save_hf` writes checkpoint tensor `key` in (t_dtype: the tensor's after the layout mapping)."""
    if layout == "k3":
        return torch.float32 if k3_layout.is_fp32_key(key) else (dt or t_dtype)
    return t_dtype if k3_layout.is_fp32_key(key) or dt is None else dt


def _items(model, layout: str, dt, mode, plain_writer: bool, expert_writer: bool, gather: _Gather) -> list:
    cfg = model.cfg
    rules = _plain_rules(cfg, layout)
    prefix = k3_layout.PREFIX if layout == "k3" else ""
    items = []
    for name, t in model.state_dict(keep_vars=True).items():
        m = _EXPERT.fullmatch(name)
        if m and expert_writer:
            if meta(t).tp_dim is not None:
                raise ValueError(f"save_hf_sharded: {name} is split by tensor parallelism; experts are not")
            i, n = int(m.group(1)), m.group(2)
            base = f"{prefix}model.layers.{i}.block_sparse_moe.experts"
            first, (o, k) = shard_offsets(t)[0], tuple(t.shape[1:])
            loaded = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "loaded_scales", {}).get(n)
            for el in range(t.shape[0]):
                key = f"{base}.{first + el}.{n}"
                if layout == "k3":
                    cache = {}

                    def quantised(part, w=t, el=el, cache=cache, loaded=loaded):
                        if not cache:
                            cache["packed"], cache["scale"] = quantize_k3_weight(
                                w.detach()[el], mode, None if loaded is None else loaded[el])
                        return cache.pop(part)

                    items.append(_Item(f"{key}.weight_packed", o * k // 2, lambda q=quantised: q("packed")))
                    items.append(_Item(f"{key}.weight_scale", o * k // BLOCK, lambda q=quantised: q("scale")))
                else:
                    out = _out_dtype(layout, key, t.dtype, dt)
                    items.append(_Item(f"{key}.weight", o * k * out.itemsize,
                                       lambda w=t, el=el, out=out: w.detach()[el].to(out).contiguous()))
        elif not m and plain_writer:
            key, fwd = rules[name]
            shaped = torch.empty(full_shape(t), dtype=t.dtype, device="meta")
            shaped = fwd(shaped) if fwd else shaped
            out = _out_dtype(layout, key, shaped.dtype, dt)

            def produce(t=t, fwd=fwd, out=out):
                whole = gather(t)
                return (fwd(whole) if fwd else whole).to(out).contiguous()

            items.append(_Item((k3_layout.checkpoint_name(key) if prefix else key), math.prod(shaped.shape) *
                               out.itemsize, produce,
                               t if meta(t).tp_dim is not None else None))
    return sorted(items, key=lambda it: it.key)


def _shards(items: list, max_shard_size: int) -> list:
    """Consecutive runs of `items` of at most max_shard_size bytes (a larger tensor alone), as write_checkpoint."""
    shards, size = [[]], 0
    for it in items:
        if shards[-1] and size + it.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    return shards if shards[0] else []


@torch.no_grad()
def save_hf_sharded(model, path, layout: str = "k3", *, tp_group=None, dtype=None,
                    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, scale_mode: str | None = None, group="auto"):
    """Write the Hugging Face directory of the model whose parts the ranks of `group` hold (module docstring):
    the tensors and config.json that `save_hf(whole model, path, layout, dtype, max_shard_size, scale_mode)`
    writes. Call it on every rank of `group` ("auto": the default group when torch.distributed is initialised;
    None: this process alone, holding the whole model). `tp_group`: this rank's tensor-parallel group, needed
    where the model is split by tensor parallelism. Returns the directory."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    path = Path(path)
    group = _resolve_group(group)
    rank, world = _world(group)
    cfg = model.cfg
    if layout == "k3":
        k3_layout.check_representable(cfg)
        dt = _dtype(dtype) or torch.bfloat16
    else:
        kimi_linear.hf_config_from(cfg)  # refuses configs the Kimi Linear layout cannot express
        dt = _dtype(dtype)
    me = _describe(model, tp_group, dist.get_rank() if group is not None else 0)
    parts = _gather(me, group)
    global_ranks = _gather(dist.get_rank() if group is not None else 0, group)
    _check_cover(parts, cfg)
    same_stage = [r for r, p in enumerate(parts) if p.stage == me.stage]
    plain_writer = min(r for r in same_stage if parts[r].tp[0] == 0)
    expert_writer = min(r for r in same_stage if parts[r].ep == me.ep)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    mode = export_scale_mode(experts[0], scale_mode) if experts and layout == "k3" else None
    writer_global = global_ranks[plain_writer]
    gather = _Gather(tp_group, writer_global, rank == plain_writer)
    items = _items(model, layout, dt, mode, rank == plain_writer, rank == expert_writer, gather)
    shards = _shards(items, max_shard_size)
    counts = _gather(len(shards), group)
    total = sum(counts)
    before = sum(counts[:rank])
    files = [SINGLE if total == 1 else f"model-{before + j + 1:05d}-of-{total:05d}.safetensors"
             for j in range(len(shards))]
    err = None
    if rank == 0:
        try:
            path.mkdir(parents=True, exist_ok=True)
            for old in list(path.glob("model*.safetensors")) + [path / INDEX, path / CONFIG]:
                if old.is_file():
                    old.unlink()
        except Exception as e:  # noqa: BLE001
            err = CheckpointWriteError(f"{path}: (stale files): cannot be removed ({one_line(e)})")
    _agree(err, group, other=CheckpointWriteError)
    # peers of the writer's tensor-parallel group send their shards, in the writer's order
    peer = rank != plain_writer and tp_group is not None and me.tp[1] > 1 and writer_global in me.tp_members
    err, weight_map = None, {}
    if peer:
        for it in _items(model, layout, dt, mode, True, False, gather):
            if it.split is not None:
                gather(it.split)
    for file, shard in zip(files, shards):
        tensors = {it.key: it.produce() for it in shard}  # gathers run even after a failed write
        if err is None:
            try:
                seen = set()
                save_file({k: _own_storage(v, seen) for k, v in tensors.items()}, str(path / file),
                          metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(tensors, file))
            except Exception as e:  # noqa: BLE001
                err = CheckpointWriteError(f"{path / file}: {next(iter(tensors))}: cannot be written "
                                           f"({one_line(e)})")
        del tensors
    nbytes = sum(it.nbytes for it in items)
    pieces = _agree(err, group, (weight_map, nbytes), other=CheckpointWriteError)
    err = None
    if rank == 0:  # the index and config.json last: a directory with an index is complete
        try:
            whole = {}
            for wm, _ in pieces:
                whole.update(wm)
            if total > 1:
                (path / INDEX).write_text(json.dumps({"metadata": {"total_size": sum(n for _, n in pieces)},
                                                         "weight_map": dict(sorted(whole.items()))}, indent=2) + "\n")
            if layout == "k3":
                hf_config = k3_layout.k3_config_dict(cfg, _dtype_name(dt))
            else:
                hf_config = kimi_linear.hf_config_dict(cfg)
                hf_config["dtype"] = _dtype_name(dt or next(model.parameters()).dtype)
            (path / CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n")
            log.info("wrote %s (%s layout, %d tensors from %d ranks)", path, layout, len(whole), world)
        except Exception as e:  # noqa: BLE001
            err = CheckpointWriteError(f"{path}: (index, config.json): cannot be written ({one_line(e)})")
    _agree(err, group, other=CheckpointWriteError)
    return path
