"""Checkpoints for an exact resume: fp32 master weights and per-parameter optimizer states (safetensors, full
size per tensor-parallel shard, so any data-parallel size or ZeRO stage can load them), RNG states, data
position and step.

Written atomically: everything goes to a temporary directory that is renamed into place only when
complete, so a crash mid-save never leaves a checkpoint that `load=auto` would pick. Loading never
unpickles arbitrary objects: safetensors for weights, `torch.load(weights_only=True)` for the rest.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

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
        with open(tmp / name, "rb") as fh:
            os.fsync(fh.fileno())


def read_shard(path: Path, suffix: str = "") -> tuple:
    """(model tensors, {param: {key: tensor}}, extra) of one shard written by `write_shard`."""
    path = Path(path)
    if not (path / f"model{suffix}.safetensors").is_file():
        raise FileNotFoundError(f"{path}: no model{suffix}.safetensors (saved under another tensor-parallel layout? "
                                f"this checkpoint has {sorted(p.name for p in path.glob('model*.safetensors'))})")
    model = load_file(str(path / f"model{suffix}.safetensors"))
    optim = {}
    for k, v in load_file(str(path / f"optim{suffix}.safetensors")).items():
        name, key = k.rsplit("::", 1)
        optim.setdefault(name, {})[key] = v
    extra = torch.load(path / f"state{suffix}.pt", weights_only=True, map_location="cpu")
    return model, optim, extra


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


def list_checkpoints(ckpt_dir: str | Path) -> list:
    """Complete checkpoints, oldest first (a directory counts only once its meta.json says complete)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    out = []
    for p in ckpt_dir.iterdir():
        if p.is_dir() and p.name.startswith(_PREFIX) and (p / "meta.json").is_file():
            try:
                if json.loads((p / "meta.json").read_text()).get("complete"):
                    out.append(p)
            except (ValueError, OSError):
                continue
    return sorted(out, key=lambda p: int(p.name[len(_PREFIX):]))


def resolve_load_path(load: str, ckpt_dir: str | Path) -> Path | None:
    """'' -> None (fresh start); 'auto' -> newest complete checkpoint in ckpt_dir or None; else a path."""
    if not load:
        return None
    if load == "auto":
        found = list_checkpoints(ckpt_dir)
        return found[-1] if found else None
    p = Path(load)
    if p.is_dir() and not (p / "meta.json").is_file():  # a checkpoint directory: take its newest
        found = list_checkpoints(p)
        if found:
            return found[-1]
    if not (p / "meta.json").is_file():
        raise FileNotFoundError(f"checkpoint.load={load!r}: no complete checkpoint there (missing meta.json)")
    return p


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {meta.get('format_version')} is not {FORMAT_VERSION} "
                         f"(written by an older megatron-k3; convert it or start fresh)")
    return meta
