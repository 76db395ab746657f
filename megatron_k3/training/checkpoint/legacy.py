"""Format 2 (full size per tensor-parallel shard, written before the sharded format): read only by
tools/convert_checkpoint.py, which writes it again in the current format."""

from __future__ import annotations

from pathlib import Path

import torch

from .directory import load_pickle_safely, load_tensors
from .shards import CheckpointError


def legacy_suffix(tp: int, tp_rank: int, pp: int = 1, pp_rank: int = 0) -> str:
    """Format 2's file-name suffix of one (tensor-parallel shard, pipeline stage): '', '_tp01', '_pp01', ..."""
    return (f"_tp{tp_rank:02d}" if tp > 1 else "") + (f"_pp{pp_rank:02d}" if pp > 1 else "")


def read_legacy_shard(path: Path, suffix: str = "") -> tuple:
    """(model tensors, {param: {key: tensor}}, extra) of one shard written by format 2."""
    path = Path(path)
    if not (path / f"model{suffix}.safetensors").is_file():
        raise CheckpointError(f"{path}: no model{suffix}.safetensors (this checkpoint has "
                              f"{sorted(p.name for p in path.glob('model*.safetensors'))})")
    model = load_tensors(path / f"model{suffix}.safetensors")
    optim = {}
    for k, v in load_tensors(path / f"optim{suffix}.safetensors").items():
        name, key = k.rsplit("::", 1)
        optim.setdefault(name, {})[key] = v
    extra = load_pickle_safely(path / f"state{suffix}.pt")
    return model, optim, extra


def read_legacy_stages(path: Path, meta: dict, tp_rank: int = 0) -> tuple:
    """(model tensors, optimizer states, extra) of one tensor-parallel shard, every pipeline stage's files merged:
    a stage holds its own parameters under their global names, so the merge is a union (the optimizer scalars,
    keyed by parameter-group rule, likewise)."""
    tp, pp = int(meta.get("tensor_parallel", 1)), int(meta.get("pipeline_parallel", 1))
    stages = [read_legacy_shard(path, legacy_suffix(tp, tp_rank, pp, s)) for s in range(pp)]
    model, optim, extra = {}, {}, dict(stages[0][2])
    scalars = {}
    for m, o, e in stages:
        model.update(m)
        optim.update(o)
        scalars.update(e.get("optimizer_scalars", {}))
    extra["optimizer_scalars"] = scalars
    return model, optim, extra


def read_legacy(path: Path, meta: dict) -> tuple:
    """A format-2 checkpoint's (model tensors, optimizer states, extra) at full, unsharded size whatever
    tensor-parallel size and pipeline split saved them: the stage files merged (`read_legacy_stages`), the shards of
    each tensor concatenated along the dimension `meta['tp_split_dims']` records. Routed experts are stored in
    global order already (gathered over expert parallelism at save time)."""
    tp = int(meta.get("tensor_parallel", 1))
    shards = [read_legacy_stages(path, meta, r) for r in range(tp)]
    if tp == 1:
        return shards[0]
    dims = meta.get("tp_split_dims")
    if dims is None:
        raise CheckpointError(f"{path}: saved with tensor_parallel={tp} but meta.json has no tp_split_dims "
                              f"(an older checkpoint); resume it with parallel.tp={tp}")

    def merge(name, parts):
        d = dims.get(name)
        return parts[0] if d is None else torch.cat(parts, dim=d)

    model = {k: merge(k, [s[0][k] for s in shards]) for k in shards[0][0]}
    optim = {n: {k: merge(n, [s[1][n][k] for s in shards]) for k in st} for n, st in shards[0][1].items()}
    return model, optim, shards[0][2]


