"""Checkpoints for an exact resume: model (safetensors), optimizer, RNG states, data position and step.

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

FORMAT_VERSION = 1
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


def _model_tensors(model: torch.nn.Module) -> dict:
    out, seen = {}, {}
    for k, v in model.state_dict().items():
        if v.data_ptr() in seen:  # tied weights are stored once; the alias is restored by load_state_dict
            continue
        seen[v.data_ptr()] = k
        out[k] = v.detach().contiguous().cpu()
    return out


def write_shard(tmp: Path, model, optimizer, suffix: str = ""):
    """Write this rank's model and optimizer files (suffix names the shard, e.g. '_tp1')."""
    save_file(_model_tensors(model), str(tmp / f"model{suffix}.safetensors"))
    torch.save({"optimizer": optimizer.state_dict(), "rng": rng_state()}, tmp / f"state{suffix}.pt")
    for name in (f"model{suffix}.safetensors", f"state{suffix}.pt"):
        with open(tmp / name, "rb") as fh:
            os.fsync(fh.fileno())


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


def save_checkpoint(ckpt_dir: str | Path, step: int, model, optimizer, meta: dict, keep_last: int = 0) -> Path:
    """One-process checkpoint: model.safetensors, state.pt (optimizer + RNG), meta.json."""
    tmp, final = begin(ckpt_dir, step)
    write_shard(tmp, model, optimizer)
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


def load_checkpoint(path: str | Path, model, optimizer=None, suffix: str = "") -> dict:
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {meta.get('format_version')} is not {FORMAT_VERSION}")
    if not (path / f"model{suffix}.safetensors").is_file():
        raise FileNotFoundError(f"{path}: no model{suffix}.safetensors (saved under another tensor-parallel layout? "
                                f"this checkpoint has {sorted(p.name for p in path.glob('model*.safetensors'))})")
    tensors = load_file(str(path / f"model{suffix}.safetensors"))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {k for k in missing if _is_alias(model, k, tensors)}
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"{path}: model keys do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
    state = torch.load(path / f"state{suffix}.pt", weights_only=True, map_location="cpu")
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    return meta


def _is_alias(model, key, tensors) -> bool:
    sd = model.state_dict()
    return any(sd[key].data_ptr() == sd[k].data_ptr() for k in tensors if k in sd and k != key)
