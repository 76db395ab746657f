"""The checkpoint directory: the protocol that makes a save atomic (a temporary directory, meta.json, the rename
into place, `latest`, pruning), finding checkpoints (`list_checkpoints`, `resolve_load_path`), meta.json and
rng.pt, the safe readers, and whole-tensor save and read for offline tools (the files themselves: shards.py).

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
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from ...config.schema import LOAD_FORMS, LOAD_FRESH
from . import shards
from .shards import CheckpointError

log = logging.getLogger("megatron_k3.checkpoint")

FORMAT_VERSION = 3  # 3: sharded, every rank writes its own pieces (shards.py); 2: full size per TP shard (legacy)
LEGACY_VERSION = 2
_PREFIX = "step_"


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


def write_rng(tmp: Path, ranks: list):
    """`rng.pt`: every rank's RNG states, in global rank order."""
    torch.save({"ranks": ranks}, tmp / "rng.pt")
    shards.fsync(tmp / "rng.pt")


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


def begin(ckpt_dir: str | Path, step: int, unique: bool = True) -> tuple:
    """(temporary directory, final directory) of a checkpoint being written."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"{_PREFIX}{step:08d}"
    tmp = ckpt_dir / (f".tmp-{final.name}-{os.getpid()}" if unique else f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp, final


def run_of(p: Path) -> str | None:
    """The run id recorded in checkpoint p's meta.json (None: unreadable, or written before run ids)."""
    try:
        return json.loads((Path(p) / "meta.json").read_text()).get("run_id")
    except (ValueError, OSError):
        return None


def commit(tmp: Path, final: Path, meta: dict, keep_last: int = 0) -> Path:
    """Write meta.json, rename the directory into place, update `latest`, prune the oldest of this run's
    checkpoints (meta["run_id"]) beyond keep_last: another run's are never removed."""
    ckpt_dir = final.parent
    meta = dict(meta, format_version=FORMAT_VERSION, saved_at=time.time(), complete=True)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    shards.fsync(tmp / "meta.json")
    if final.exists():  # a re-save of the same step: move the old one aside first
        old = ckpt_dir / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    shards.fsync(ckpt_dir)
    latest_tmp = ckpt_dir / f".latest-{os.getpid()}"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, ckpt_dir / "latest")
    if keep_last > 0:
        own = [p for p in list_checkpoints(ckpt_dir) if run_of(p) == meta.get("run_id")]
        for old in own[:-keep_last]:
            if old != final:  # never the one just committed
                shutil.rmtree(old, ignore_errors=True)
    for stale in ckpt_dir.glob(".tmp-step_*"):  # saves that failed or were killed (reported at the start)
        shutil.rmtree(stale, ignore_errors=True)
    return final


def save_checkpoint(ckpt_dir: str | Path, step: int, model: dict, optim: dict, scalars: dict, meta: dict,
                    rngs: list | None = None, keep_last: int = 0) -> Path:
    """A checkpoint written by one process from whole tensors ({name: tensor}, {name: {state key: tensor}}, the
    optimizers' scalars by group): the sharded format with one writer, committed atomically. Any layout loads
    it (tools/convert_checkpoint.py writes with this)."""
    pieces = shards.RankPieces()
    tensors = dict(model)
    tensors.update({f"{n}::{k}": v for n, st in optim.items() for k, v in st.items()})
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        pieces.add(name, t.shape, (0,) * t.dim(), t.shape, t)
    tmp, final = begin(ckpt_dir, step)
    pieces.write(tmp, 0)
    if rngs:
        write_rng(tmp, rngs)
    shards.merge_index(tmp, 1)
    return commit(tmp, final, dict(meta, step=step, optimizer_scalars=scalars), keep_last)


def read_full(path: str | Path, states: bool = True) -> tuple:
    """({name: tensor} of the weights and buffers, {name: {state key: tensor}} (empty with states=False), meta) of a
    checkpoint, at full size (offline tools: conversion to Hugging Face layouts, tests)."""
    meta = read_meta(path)
    index = shards.ShardIndex(path)
    try:
        model, optim = {}, {}
        for name in index.names():
            if "::" in name:
                if states:
                    owner, key = name.rsplit("::", 1)
                    optim.setdefault(owner, {})[key] = index.read_full(name)
            else:
                model[name] = index.read_full(name)
    finally:
        index.close()
    return model, optim, meta


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


def is_hf_directory(p: Path) -> bool:
    """A Hugging Face directory (config.json and safetensors weights, no meta.json): the Kimi K3 or Kimi Linear
    layout, which `checkpoint.load` starts a run from."""
    p = Path(p)
    return (p / "config.json").is_file() and not (p / "meta.json").is_file() and (
        (p / "model.safetensors.index.json").is_file() or (p / "model.safetensors").is_file())


def resolve_load_path(load: str, ckpt_dir: str | Path) -> Path | None:
    """'none' (or '') -> None (fresh start); 'auto' -> newest complete checkpoint in ckpt_dir or None; else a path
    (a checkpoint, a checkpoint directory's newest, or a Hugging Face directory)."""
    if load in LOAD_FRESH:
        return None
    if load == "auto":
        found = list_checkpoints(ckpt_dir, warn=True)
        return found[-1] if found else None
    p = Path(load)
    if not p.is_dir():
        raise FileNotFoundError(f"{'not a directory' if p.exists() else 'no such directory'}; {LOAD_FORMS}")
    if is_hf_directory(p):  # pretrained weights (the released K3 checkpoint): streamed in by every rank
        return p
    if not (p / "meta.json").is_file():  # a checkpoint directory: take its newest
        found = list_checkpoints(p, warn=True)
        if found:
            return found[-1]
        raise FileNotFoundError(f"no meta.json, no complete step_* checkpoint inside and no Hugging Face config.json "
                                f"with safetensors weights; {LOAD_FORMS}")
    return p


def peft_base_directory(run, saved: dict | None = None) -> tuple:
    """peft=lora's frozen base: (the config key that names it, its path) or (None, None). peft.base, else
    checkpoint.load where that is a Hugging Face directory, else the base a resumed checkpoint's meta.json records
    (`saved`), so that a restarted command with checkpoint.load=auto reads the same base again."""
    if run.peft.base:
        return "peft.base", Path(run.peft.base)
    load = run.checkpoint.load
    if load not in ("auto", "none", "") and is_hf_directory(Path(load)):
        return "checkpoint.load", Path(load)
    recorded = ((saved or {}).get("peft") or {}).get("base")
    if recorded:
        return "peft.base", Path(recorded)
    return None, None


def unreadable_file(path: Path) -> str | None:
    """The first file of checkpoint `path` that cannot be read as written (meta.json, the index, a rank's
    safetensors file: missing, truncated or corrupted header), as "<file>: <why>"; None when all open."""
    try:
        read_meta(path)
        files = {c[0] for t in json.loads((path / shards.INDEX).read_text())["tensors"].values() for c in t["chunks"]}
    except (CheckpointError, ValueError, KeyError, OSError) as e:
        return f"{path}: {e}"
    for name in sorted(files):
        try:
            with safe_open(str(path / name), framework="pt", device="cpu") as f:
                f.keys()
        except (SafetensorError, OSError, ValueError) as e:
            return f"{path / name}: {e}"
    return None


def newest_intact(ckpt_dir: Path, before: Path) -> Path | None:
    """The newest complete checkpoint in ckpt_dir other than `before` (and older, where `before` is a step
    directory) whose files all open (`unreadable_file`)."""
    step = before.name[len(_PREFIX):]
    older = [p for p in list_checkpoints(ckpt_dir) if p.resolve() != before.resolve()
             and (not step.isdigit() or int(p.name[len(_PREFIX):]) < int(step))]
    return next((p for p in reversed(older) if unreadable_file(p) is None), None)


def read_meta(path: str | Path, legacy: bool = False) -> dict:
    """meta.json of a checkpoint in the current format (legacy=True: also format 2, which only
    tools/convert_checkpoint.py reads)."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path / 'meta.json'}: unreadable ({e})") from None
    version = meta.get("format_version")
    if version == LEGACY_VERSION and not legacy:
        raise CheckpointError(f"{path}: checkpoint format {version} (full size per tensor-parallel shard, written "
                              f"before the sharded format {FORMAT_VERSION}); convert it once with `python "
                              f"tools/convert_checkpoint.py {path} NEW_DIR` and load NEW_DIR")
    if version not in (FORMAT_VERSION, LEGACY_VERSION):
        raise CheckpointError(f"{path}: checkpoint format {version} is not {FORMAT_VERSION} (written by another "
                              f"megatron-k3 version)")
    return meta
