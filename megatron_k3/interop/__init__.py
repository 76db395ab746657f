"""Checkpoint layouts of other stacks (Hugging Face Kimi Linear, Kimi K3): `load_hf(path)` and `save_hf(model, path,
layout=...)` are the entry points (interop.hf); `load_hf_sharded(model, path)` / `save_hf_sharded(model, path,
tp_group=...)` read and write the same directories from the ranks of a parallel layout, each rank only its part
(interop.sharded)."""

from .hf import load_hf, save_hf
from .sharded import (
    CheckpointReadError,
    CheckpointWriteError,
    LoadReport,
    MissingShardError,
    load_hf_sharded,
    save_hf_sharded,
)

__all__ = ["load_hf", "save_hf", "load_hf_sharded", "save_hf_sharded", "LoadReport", "CheckpointReadError",
           "MissingShardError", "CheckpointWriteError"]
