"""Streaming, sharded import of Hugging Face directories (the Kimi K3 and Kimi Linear families, family.py): every
rank of any layout (tensor parallel, expert parallel, a pipeline stage, replicas) reads only its part.

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

Kimi Linear directories are read in the checkpoint naming (per-expert `.weight`, separate conv filters, also the
dense MLP under `block_sparse_moe.` that transformers writes); transformers' in-memory naming (fused
`conv1d.weight` / `experts.gate_up_proj`) is not sliced: `load_hf` reads such a directory whole.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..annotations import full_shape, shard_offsets
from ..errors import one_line
from ..peft.experts import MATRICES, FrozenExperts
from ..peft.lora import is_adapter
from . import k3_layout
from .directory import (
    CONFIG,
    INDEX,
    CheckpointReadError,
    ConfigMismatchError,
    MissingShardError,
    config_differences,
    detect_layout,
    read_index,
)
from .family import CheckpointFamily, family
from .k3_experts import BLOCK, dequantize_k3_weight, remember_scales
from .parts import EXPERT, agree, rank_and_size, resolve_group, targets

log = logging.getLogger(__name__)

READ_BUDGET = 256 << 20  # bytes read from one memory map before it is closed and re-opened

__all__ = ["load_hf_sharded", "LoadReport", "READ_BUDGET"]


@dataclass
class LoadReport:
    """What one rank's `load_hf_sharded` did."""
    layout: str
    files: list = field(default_factory=list)  # the shard files this rank opened (names within the directory)
    tensors: int = 0  # checkpoint tensors read (a packed expert matrix and its scales count as two)
    bytes_read: int = 0  # bytes of the slices read
    skipped: int = 0  # vision-tower tensors in the directory, not read
    # {our name: this rank's slice as stored} for plain tensors stored wider than the module holds them (K3's fp32
    # tensors under bf16 module weights): the fp32 masters are set from these, so the values never pass through
    # the narrower dtype (tensors of that kind only: KDA's conv, A_log, dt_bias and o_norm in the K3 release)
    wider: dict = field(default_factory=dict)


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
    """Our state-dict names -> checkpoint names of one directory, for one config and checkpoint family (its pair
    list, family.pairs). `present`: the directory's tensor names."""

    def __init__(self, cfg, fam: CheckpointFamily, present, where: Path):
        self.cfg, self.family, self.where = cfg, fam, where
        self.actual, self.skipped = {}, 0  # {name without the family's prefix: name in the directory}
        self.prefixed = bool(fam.prefix) and any(k.startswith(fam.prefix) for k in present)
        for k in present:
            if k.startswith(k3_layout.FOREIGN_PREFIXES) and not fam.reads_vision(cfg):
                self.skipped += 1
            elif fam.prefix and k.startswith(fam.prefix):
                self.actual[k[len(fam.prefix):]] = k
            else:
                self.actual.setdefault(k, k)
        problem = fam.naming_problem(self.actual)
        if problem:
            raise CheckpointReadError(f"{where}: (naming): {problem}")
        self.plain = fam.plain_names(cfg, self.actual)  # our name -> (checkpoint name, kind)
        self.experts = {}  # layer -> (checkpoint prefix, "mxfp4" or "dense")
        for i in fam.moe_layers(cfg):
            prefix = f"model.layers.{i}.block_sparse_moe.experts"
            self.experts[i] = (prefix, fam.expert_form(prefix, self.actual))

    def expert_keys(self, i: int, e: int, n: str) -> dict:
        """{part: checkpoint name} of expert e's matrix n in layer i: "weight", or "packed" and "scale"."""
        prefix, form = self.experts[i]
        if form == "dense":
            return {"weight": f"{prefix}.{e}.{n}.weight"}
        return {"packed": f"{prefix}.{e}.{n}.weight_packed", "scale": f"{prefix}.{e}.{n}.weight_scale"}

    def name(self, key: str) -> str:
        """The name of `key` in the directory (with the family's prefix where the directory uses it)."""
        if key in self.actual:
            return self.actual[key]
        return self.family.checkpoint_name(key) if self.prefixed else key

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
                                      f"({self.family.name} layout; {len(unknown)} such tensor(s))")


# ------------------------------------------------------------------------------------------------ reads
@dataclass
class _Read:
    key: str  # name in the directory
    shape: tuple  # its shape as the config implies
    region: tuple  # the slice this rank reads
    apply: object  # apply(view): consume the slice while its file is open
    u8: bool = False  # a packed MXFP4 part: stored as U8
    padding: tuple | None = None


def _plan_reads(model, names: _Names, wider: dict) -> list:
    """This rank's reads: one per plain tensor (its slice), one or two per local expert matrix. A plain tensor
    stored in a wider floating dtype than its parameter is also kept, as stored, in `wider` (LoadReport.wider)."""
    reads, pending = [], {}

    def copy_into(dst, name=None):
        def apply(view):
            view = view.reshape(dst.shape)
            dst.copy_(view)
            if name is not None and view.is_floating_point() and view.element_size() > dst.element_size():
                wider[name] = view.clone()
        return apply

    for name, t in targets(model):
        if is_adapter(name):  # peft=lora's adapters: not in a base checkpoint
            continue
        start, size, shape = shard_offsets(t), tuple(t.shape), full_shape(t)
        m = EXPERT.fullmatch(name)
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
            raise CheckpointReadError(f"{names.where}: {name}: our tensor has no {names.family.name} name")
        key, kind = names.plain[name]
        src = _source(names.name(key), kind, shape)
        reads.append(_Read(src.key, src.shape, src.region(start, size), copy_into(t, name), padding=src.padding))
    return reads + _frozen_expert_reads(model, names)


def _frozen_expert_reads(model, names: _Names) -> list:
    """peft=lora's frozen experts (peft.FrozenExperts): each local expert's MXFP4 codes and scales copied as stored
    into the module's uint8 buffers, nothing decoded. A directory that stores the experts dense cannot be the
    frozen MXFP4 base."""
    reads = []
    for name, fe in model.named_modules():
        if not isinstance(fe, FrozenExperts):
            continue
        i = int(EXPERT.fullmatch(f"{name}.w1").group(1))
        if names.experts.get(i, (None, None))[1] != "mxfp4":
            raise CheckpointReadError(f"{names.where}: {names.experts.get(i, (name,))[0]}: peft=lora keeps the routed "
                                      "experts frozen as MXFP4 codes; this directory stores them dense (convert it "
                                      "with tools/convert_checkpoint.py --to-hf --layout k3 first)")
        for n in MATRICES:
            for kind in ("packed", "scale"):
                buf = getattr(fe, f"{n}_{kind}")
                for el in range(buf.shape[0]):
                    key = names.name(names.expert_keys(i, fe.expert_offset + el, n)[kind])
                    reads.append(_Read(key, tuple(buf.shape[1:]), (slice(0, buf.shape[1]), slice(0, buf.shape[2])),
                                       _copy_to(buf[el]), u8=True))
    return reads


def _copy_to(dst):
    def apply(view):
        dst.copy_(view)
    return apply


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
    group = resolve_group(group)
    rank, _ = rank_and_size(group)
    err, report, by_file = None, None, {}
    try:
        if not (path / CONFIG).is_file():
            raise MissingShardError(f"{path / CONFIG}: (config): no {CONFIG}")
        hf_config = json.loads((path / CONFIG).read_text())
        fam = family(detect_layout(hf_config) if layout == "auto" else layout)
        diffs = config_differences(model.cfg, fam.config_to(hf_config, vision=model.cfg.vision.enabled))
        if diffs:
            raise ConfigMismatchError(path, diffs)
        weight_map, where = read_index(path)
        for file in sorted(set(weight_map.values())):
            if not (path / file).is_file():
                first = min(k for k, v in weight_map.items() if v == file)
                raise MissingShardError(f"{path / file}: {first}: the shard file is missing ({where.name} names it)")
        names = _Names(model.cfg, fam, weight_map, where)
        names.check_complete()
        if any(t.is_meta for _, t in targets(model)):
            model.materialize(device or "cpu", init=False)
        wider = {}
        for r in sorted(_plan_reads(model, names, wider), key=lambda r: r.key):
            by_file.setdefault(weight_map[r.key], []).append(r)
        for file, reads in sorted(by_file.items()):
            _check_file(path / file, reads)
        report = LoadReport(fam.name, sorted(by_file), skipped=names.skipped, wider=wider)
    except Exception as e:  # noqa: BLE001 - agreed over the group, then raised on every rank
        err = e
    agree(err, group)
    if report.skipped and rank == 0:
        log.info("%s: skipped %d vision-tower tensors (vision_tower., mm_projector.)", path, report.skipped)
    err = None
    try:
        for file, reads in sorted(by_file.items()):
            _read_file(path / file, reads, report)
    except Exception as e:  # noqa: BLE001
        err = e
    agree(err, group)
    log.debug("%s: read %d tensors (%d bytes) from %d files", path, report.tensors, report.bytes_read,
              len(report.files))
    return report
