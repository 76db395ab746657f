"""Streaming, sharded export of Hugging Face directories (the Kimi K3 and Kimi Linear families, family.py): every
rank of any layout writes only its part.

`save_hf_sharded(model, path, tp_group=...)` writes the directory that `save_hf` writes for the unsharded model,
tensor for tensor, from the ranks' parts. A checkpoint tensor has one writer, the lowest global rank that holds it
whole: the non-expert tensors of a pipeline stage are written by the stage's lowest rank at tensor-parallel rank 0,
which gathers the tensor-parallel shards from its own tensor-parallel group only (one tensor at a time); a block of
routed experts (not split by tensor parallelism) by the lowest rank holding it, which quantises only that block.
Each writer packs its tensors into files of at most `max_shard_size` bytes; the file names are numbered over all
writers (`model-0000i-of-0000n.safetensors`) from the file counts every rank shares first; after every rank wrote,
rank 0 writes `model.safetensors.index.json` and config.json. A failed write is raised on every rank and leaves no
index.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from ..annotations import full_shape, meta, shard_offsets
from ..errors import one_line
from ..model.experts import GroupedExperts
from .directory import CONFIG, DEFAULT_MAX_SHARD_SIZE, INDEX, SINGLE, dtype_of, own_storage
from .family import CheckpointFamily, family
from .k3_experts import BLOCK, export_scale_mode, quantize_k3_weight
from .parts import EXPERT, agree, gather_all, rank_and_size, resolve_group, targets

log = logging.getLogger(__name__)

__all__ = ["save_hf_sharded", "wider_than_module", "CheckpointWriteError"]


class CheckpointWriteError(OSError):
    """A shard file, the index or config.json that could not be written: one line, `<file>: <tensor>: <what>`."""


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
    for _, t in targets(model):
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
    split: tuple | None = None  # (the tensor-parallel shard this item gathers, its value or None), if any


class _Gather:
    """A tensor-parallel-split tensor made whole on the writer: gathered over the writer's tensor-parallel group."""

    def __init__(self, tp_group, writer: int, is_writer: bool):
        self.group, self.writer, self.is_writer = tp_group, writer, is_writer

    def __call__(self, t: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor | None:
        """t made whole (on the writer; None elsewhere): `value`, where given, in place of t's own (same shape)."""
        m = meta(t)
        local = (t if value is None else value).detach().contiguous()
        if m.tp_dim is None:
            return local
        parts = [torch.empty_like(local) for _ in range(m.tp_size)] if self.is_writer else None
        dist.gather(local, parts, dst=self.writer, group=self.group)
        return torch.cat(parts, dim=m.tp_dim) if self.is_writer else None


def _rules(fam: CheckpointFamily, cfg) -> dict:
    """{our name of a plain tensor: (its checkpoint key, the forward mapping or None)}."""
    return {ours: (key, fwd) for ours, key, fwd, _ in fam.pairs(cfg)}


def _written_dtype(fam: CheckpointFamily, key: str, fwd, t: torch.Tensor, dt) -> tuple:
    """(the whole tensor's shape as written, the dtype written) of our tensor t under checkpoint key `key`."""
    shaped = torch.empty(full_shape(t), dtype=t.dtype, device="meta")
    shaped = fwd(shaped) if fwd else shaped
    return shaped.shape, fam.out_dtype(key, shaped.dtype, dt)


def wider_than_module(model, layout: str = "k3", dtype=None) -> list:
    """Names of the plain parameters that `save_hf_sharded(model, ..., layout, dtype=dtype)` writes in a wider
    dtype than the module holds them (K3's fp32 tensors under bf16 module weights): their fp32 masters are what
    should be written (`values`)."""
    fam = family(layout)
    dt = dtype_of(dtype) or fam.default_dtype
    rules = _rules(fam, model.cfg)
    out = []
    for name, p in model.named_parameters():
        if name in rules and not EXPERT.fullmatch(name) and p.is_floating_point():
            key, fwd = rules[name]
            if _written_dtype(fam, key, fwd, p, dt)[1].itemsize > p.element_size():
                out.append(name)
    return out


def _items(model, fam: CheckpointFamily, dt, mode, *, plain_writer: bool, expert_writer: bool,
           gather: _Gather, values: dict) -> list:
    """What this rank writes: the plain (non-expert) tensors where it is their writer (from `values` where it
    holds them), its block of routed experts where it is theirs, each as an _Item that produces the tensor when
    its file is written."""
    cfg = model.cfg
    rules = _rules(fam, cfg)
    prefix = fam.prefix
    items = []
    for name, t in model.state_dict(keep_vars=True).items():
        m = EXPERT.fullmatch(name)
        if m and expert_writer:
            if meta(t).tp_dim is not None:
                raise ValueError(f"save_hf_sharded: {name} is split by tensor parallelism; experts are not")
            i, n = int(m.group(1)), m.group(2)
            base = f"{prefix}model.layers.{i}.block_sparse_moe.experts"
            first, (o, k) = shard_offsets(t)[0], tuple(t.shape[1:])
            loaded = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "loaded_scales", {}).get(n)
            for el in range(t.shape[0]):
                key = f"{base}.{first + el}.{n}"
                if fam.quantised_experts:
                    cache = {}

                    def quantised(part, w=t, el=el, cache=cache, loaded=loaded):
                        if not cache:
                            cache["packed"], cache["scale"] = quantize_k3_weight(
                                w.detach()[el], mode, None if loaded is None else loaded[el])
                        return cache.pop(part)

                    items.append(_Item(f"{key}.weight_packed", o * k // 2, lambda q=quantised: q("packed")))
                    items.append(_Item(f"{key}.weight_scale", o * k // BLOCK, lambda q=quantised: q("scale")))
                else:
                    out = fam.out_dtype(key, t.dtype, dt)
                    items.append(_Item(f"{key}.weight", o * k * out.itemsize,
                                       lambda w=t, el=el, out=out: w.detach()[el].to(out).contiguous()))
        elif not m and plain_writer:
            key, fwd = rules[name]
            shape, out = _written_dtype(fam, key, fwd, t, dt)
            value = values.get(name)

            def produce(t=t, fwd=fwd, out=out, value=value):
                whole = gather(t, value)
                return (fwd(whole) if fwd else whole).to(out).contiguous()

            items.append(_Item(fam.checkpoint_name(key), math.prod(shape) * out.itemsize, produce,
                               (t, value) if meta(t).tp_dim is not None else None))
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
                    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, scale_mode: str | None = None, group="auto",
                    values: dict | None = None):
    """Write the Hugging Face directory of the model whose parts the ranks of `group` hold (module docstring):
    the tensors and config.json that `save_hf(whole model, path, layout, dtype, max_shard_size, scale_mode)`
    writes. Call it on every rank of `group` ("auto": the default group when torch.distributed is initialised;
    None: this process alone, holding the whole model). `tp_group`: this rank's tensor-parallel group, needed
    where the model is split by tensor parallelism. `values`: {name: tensor of the parameter's shape} written in place
    of plain parameters' own values (the fp32 masters of `wider_than_module(model, layout, dtype)`: a bf16 module
    weight would round what the layout stores in fp32). Returns the directory."""
    fam = family(layout)
    path = Path(path)
    group = resolve_group(group)
    rank, world = rank_and_size(group)
    cfg = model.cfg
    fam.check_writable(cfg)
    dt = dtype_of(dtype) or fam.default_dtype
    me = _describe(model, tp_group, dist.get_rank() if group is not None else 0)
    parts = gather_all(me, group)
    global_ranks = gather_all(dist.get_rank() if group is not None else 0, group)
    _check_cover(parts, cfg)
    same_stage = [r for r, p in enumerate(parts) if p.stage == me.stage]
    plain_writer = min(r for r in same_stage if parts[r].tp[0] == 0)
    expert_writer = min(r for r in same_stage if parts[r].ep == me.ep)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    mode = export_scale_mode(experts[0], scale_mode) if experts and fam.quantised_experts else None
    writer_global = global_ranks[plain_writer]
    gather = _Gather(tp_group, writer_global, rank == plain_writer)
    values = values or {}
    items = _items(model, fam, dt, mode, plain_writer=rank == plain_writer, expert_writer=rank == expert_writer,
                   gather=gather, values=values)
    shards = _shards(items, max_shard_size)
    counts = gather_all(len(shards), group)
    total = sum(counts)
    before = sum(counts[:rank])
    files = [SINGLE if total == 1 else f"model-{before + j + 1:05d}-of-{total:05d}.safetensors"
             for j in range(len(shards))]
    agree(_clear(path) if rank == 0 else None, group, other=CheckpointWriteError)
    # peers of the writer's tensor-parallel group send their shards, in the writer's order
    peer = rank != plain_writer and tp_group is not None and me.tp[1] > 1 and writer_global in me.tp_members
    if peer:
        for it in _items(model, fam, dt, mode, plain_writer=True, expert_writer=False, gather=gather, values=values):
            if it.split is not None:
                gather(*it.split)
    err, weight_map = _write_shards(path, files, shards)
    pieces = agree(err, group, (weight_map, sum(it.nbytes for it in items)), other=CheckpointWriteError)
    err = None
    if rank == 0:  # the index and config.json last: a directory with an index is complete
        err = _write_index(path, pieces, total, lambda: fam.config_dict(cfg, dt or next(model.parameters()).dtype),
                           f"{fam.name} layout", world)
    agree(err, group, other=CheckpointWriteError)
    return path


def _clear(path: Path):
    """Create `path` and remove a previous export's files from it: None, or the CheckpointWriteError."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        for old in list(path.glob("model*.safetensors")) + [path / INDEX, path / CONFIG]:
            if old.is_file():
                old.unlink()
    except Exception as e:  # noqa: BLE001
        return CheckpointWriteError(f"{path}: (stale files): cannot be removed ({one_line(e)})")
    return None


def _write_shards(path: Path, files: list, shards: list):
    """Write this rank's shards (each item produced even after a failed write: its TP gathers must run): (None or
    the CheckpointWriteError, {key: file} of what was written)."""
    err, weight_map = None, {}
    for file, shard in zip(files, shards):
        tensors = {it.key: it.produce() for it in shard}
        if err is None:
            try:
                seen = set()
                save_file({k: own_storage(v, seen) for k, v in tensors.items()}, str(path / file),
                          metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(tensors, file))
            except Exception as e:  # noqa: BLE001
                err = CheckpointWriteError(f"{path / file}: {next(iter(tensors))}: cannot be written "
                                           f"({one_line(e)})")
        del tensors
    return err, weight_map


def _write_index(path: Path, pieces: list, total: int, hf_config, what: str, world: int):
    """The index (over every rank's (weight map, bytes) `pieces`, when there are several files) and config.json
    (hf_config() its dict): None, or the CheckpointWriteError."""
    try:
        whole = {}
        for wm, _ in pieces:
            whole.update(wm)
        if total > 1:
            (path / INDEX).write_text(json.dumps({"metadata": {"total_size": sum(n for _, n in pieces)},
                                                     "weight_map": dict(sorted(whole.items()))}, indent=2) + "\n")
        (path / CONFIG).write_text(json.dumps(hf_config(), indent=2) + "\n")
        log.info("wrote %s (%s, %d tensors from %d ranks)", path, what, len(whole), world)
    except Exception as e:  # noqa: BLE001
        return CheckpointWriteError(f"{path}: (index, config.json): cannot be written ({one_line(e)})")
    return None
