"""Checkpoints for an exact resume: fp32 master weights and per-parameter optimizer states (safetensors, full
size per tensor-parallel shard, so any data-parallel size or ZeRO stage can load them), RNG states, data
position and step.

Written atomically: everything goes to a temporary directory that is renamed into place only when
complete, so a crash mid-save never leaves a checkpoint that `load=auto` would pick. Loading never
unpickles arbitrary objects: safetensors for weights, `torch.load(weights_only=True)` for the rest.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

log = logging.getLogger("megatron_k3.checkpoint")

FORMAT_VERSION = 2  # 2: fp32 masters + per-parameter optimizer states (any DP size)
_PREFIX = "step_"


def _fsync_dir(path: Path):
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict):
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def write_shard(tmp: Path, suffix: str, model: dict, optim: dict, extra: dict):
    """Write one shard's files (suffix names it, e.g. '_tp01'): `model{suffix}.safetensors` (fp32 master weights
    and buffers under the module's state-dict names), `optim{suffix}.safetensors` (each parameter's optimizer
    states, full size, as `name::key`), `state{suffix}.pt` (RNG and optimizer scalars; tensors and plain types
    only, so it loads with weights_only=True)."""
    flat = {f"{n}::{k}": v.contiguous() for n, st in optim.items() for k, v in st.items()}
    files = {f"model{suffix}.safetensors": lambda f: save_file({k: v.contiguous() for k, v in model.items()}, f),
             f"optim{suffix}.safetensors": lambda f: save_file(flat, f),
             f"state{suffix}.pt": lambda f: torch.save(extra, f)}
    for name, write in files.items():
        write(str(tmp / name))
        _fsync(tmp / name)


def write_rng(tmp: Path, ranks: list):
    """`rng.pt`: every rank's RNG states, in global rank order."""
    torch.save({"ranks": ranks}, tmp / "rng.pt")
    _fsync(tmp / "rng.pt")


def _fsync(path: Path):
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated, corrupted or unsafe; the message names the file."""


def load_tensors(path: Path) -> dict:
    """A safetensors file, with a clear error naming it when it is missing, truncated or not safetensors."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); truncated or corrupted?") from None


def load_pickle_safely(path: Path):
    """`torch.load(weights_only=True)`: tensors, numbers, strings, lists, tuples and dicts only. A pickle that would
    build any other object (and so could run code on load) is refused, naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        detail = next((line.strip() for line in first if "GLOBAL" in line or "Unsupported" in line),
                      first[0] if first else "")
        raise CheckpointError(f"{path}: refused to unpickle: it contains objects other than tensors and plain data, "
                              f"which could run code when loaded (crafted or foreign file?): {detail}") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                              f"truncated or corrupted?") from None


def read_shard(path: Path, suffix: str = "") -> tuple:
    """(model tensors, {param: {key: tensor}}, extra) of one shard written by `write_shard`."""
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


def config_diff(saved: dict, current: dict, prefix: str = "") -> list:
    """[(key, saved value, current value)] for every key whose value differs (nested keys dotted)."""
    out = []
    for k in sorted(set(saved) | set(current)):
        a, b = saved.get(k, "<absent>"), current.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, f"{prefix}{k}.")
        elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            if list(a) != list(b):
                out.append((prefix + k, list(a), list(b)))
        elif a != b:
            out.append((prefix + k, a, b))
    return out


def shard_suffix(tp: int, tp_rank: int, pp: int = 1, pp_rank: int = 0) -> str:
    """The file-name suffix of one (tensor-parallel shard, pipeline stage): '', '_tp01', '_pp01', '_tp01_pp01'."""
    return (f"_tp{tp_rank:02d}" if tp > 1 else "") + (f"_pp{pp_rank:02d}" if pp > 1 else "")


def read_stages(path: Path, meta: dict, tp_rank: int = 0) -> tuple:
    """(model tensors, optimizer states, extra) of one tensor-parallel shard, every pipeline stage's files merged:
    a stage holds its own parameters under their global names, so the merge is a union (the optimizer scalars,
    keyed by parameter-group rule, likewise)."""
    tp, pp = int(meta.get("tensor_parallel", 1)), int(meta.get("pipeline_parallel", 1))
    stages = [read_shard(path, shard_suffix(tp, tp_rank, pp, s)) for s in range(pp)]
    model, optim, extra = {}, {}, dict(stages[0][2])
    scalars = {}
    for m, o, e in stages:
        model.update(m)
        optim.update(o)
        scalars.update(e.get("optimizer_scalars", {}))
    extra["optimizer_scalars"] = scalars
    return model, optim, extra


def read_full(path: Path, meta: dict) -> tuple:
    """(model tensors, optimizer states, extra) at full, unsharded size whatever tensor-parallel size and pipeline
    split saved them: the stage files merged (`read_stages`), the shards of each tensor concatenated along the
    dimension `meta['tp_split_dims']` records. Routed experts are stored in global order already (gathered over
    expert parallelism at save time)."""
    tp = int(meta.get("tensor_parallel", 1))
    shards = [read_stages(path, meta, r) for r in range(tp)]
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


def split_full(full: dict, dims: dict, tp: int, tp_rank: int) -> dict:
    """This tensor-parallel rank's slice of each full tensor (the inverse of `read_full`'s merge)."""
    return {k: (v if dims.get(k) is None or tp == 1 else v.chunk(tp, dim=dims[k])[tp_rank].contiguous())
            for k, v in full.items()}


def split_shard(model: dict, optim: dict, dims: dict, tp: int, tp_rank: int) -> tuple:
    """`split_full` of the model tensors and of every parameter's optimizer states (shaped like the parameter)."""
    return (split_full(model, dims, tp, tp_rank),
            {n: split_full(st, {k: dims.get(n) for k in st}, tp, tp_rank) for n, st in optim.items()})


def begin(ckpt_dir: str | Path, step: int, unique: bool = True) -> tuple:
    """(temporary directory, final directory) of a checkpoint being written."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"{_PREFIX}{step:08d}"
    tmp = ckpt_dir / (f".tmp-{final.name}-{os.getpid()}" if unique else f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp, final


def commit(tmp: Path, final: Path, meta: dict, keep_last: int = 0) -> Path:
    """Write meta.json, rename the directory into place, update `latest`, prune old checkpoints."""
    ckpt_dir = final.parent
    meta = dict(meta, format_version=FORMAT_VERSION, saved_at=time.time(), complete=True)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    if final.exists():  # a re-save of the same step: move the old one aside first
        old = ckpt_dir / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(ckpt_dir)
    latest_tmp = ckpt_dir / f".latest-{os.getpid()}"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, ckpt_dir / "latest")
    if keep_last > 0:
        for old in list_checkpoints(ckpt_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def save_checkpoint(ckpt_dir: str | Path, step: int, model: dict, optim: dict, extra: dict, meta: dict,
                    keep_last: int = 0) -> Path:
    """A one-shard checkpoint: `write_shard` files plus meta.json, committed atomically."""
    tmp, final = begin(ckpt_dir, step)
    write_shard(tmp, "", model, optim, extra)
    return commit(tmp, final, dict(meta, step=step), keep_last)


def incomplete_checkpoints(ckpt_dir: str | Path) -> list:
    """Directories an interrupted save left behind: temporary ones never renamed into place, and step directories
    without a complete meta.json."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    out = []
    for p in sorted(ckpt_dir.iterdir()):
        if not p.is_dir():
            continue
        if p.name.startswith((".tmp-", ".old-")):
            out.append(p)
        elif p.name.startswith(_PREFIX) and not _complete(p):
            out.append(p)
    return out


def _complete(p: Path) -> bool:
    try:
        return bool(json.loads((p / "meta.json").read_text()).get("complete"))
    except (ValueError, OSError):
        return False


def list_checkpoints(ckpt_dir: str | Path, warn: bool = False) -> list:
    """Complete checkpoints, oldest first (a directory counts only once its meta.json says complete). With
    warn=True, incomplete ones (an interrupted save) are reported in the log."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    if warn:
        for p in incomplete_checkpoints(ckpt_dir):
            log.warning("ignoring incomplete checkpoint %s (a save that was interrupted); the newest complete "
                        "checkpoint is used instead", p)
    out = [p for p in ckpt_dir.iterdir()
           if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit()
           and _complete(p)]
    return sorted(out, key=lambda p: int(p.name[len(_PREFIX):]))


def resolve_load_path(load: str, ckpt_dir: str | Path) -> Path | None:
    """'' -> None (fresh start); 'auto' -> newest complete checkpoint in ckpt_dir or None; else a path."""
    if not load:
        return None
    if load == "auto":
        found = list_checkpoints(ckpt_dir, warn=True)
        return found[-1] if found else None
    p = Path(load)
    if p.is_dir() and not (p / "meta.json").is_file():  # a checkpoint directory: take its newest
        found = list_checkpoints(p, warn=True)
        if found:
            return found[-1]
    if not (p / "meta.json").is_file():
        raise FileNotFoundError(f"checkpoint.load={load!r}: no complete checkpoint there (missing meta.json)")
    return p


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path / 'meta.json'}: unreadable ({e})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {meta.get('format_version')} is not {FORMAT_VERSION} "
                         f"(written by an older megatron-k3; convert it or start fresh)")
    return meta
