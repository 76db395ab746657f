"""A training run's checkpoints. `manager`: what the Trainer calls (`CheckpointManager.save` / `resume`, every rank
taking part); `deepspeed_state`: the optimizer state per parameter, whatever keeps it (the one reader of DeepSpeed's
internals); `shards`: the sharded file format (format 3); `directory`: the directory protocol (atomic commit,
`latest`, finding checkpoints) and the safe readers; `legacy`: format 2, for tools/convert_checkpoint.py."""

from .directory import (
    FORMAT_VERSION,
    begin,
    commit,
    config_diff,
    incomplete_checkpoints,
    is_hf_directory,
    list_checkpoints,
    load_pickle_safely,
    load_tensors,
    newest_intact,
    read_full,
    read_meta,
    resolve_load_path,
    run_of,
    save_checkpoint,
    unreadable_file,
)
from .manager import CheckpointManager, Position, Ranks
from .shards import CheckpointError, RankPieces, ShardIndex

__all__ = ["CheckpointManager", "Position", "Ranks", "CheckpointError", "RankPieces", "ShardIndex", "FORMAT_VERSION",
           "begin", "commit", "config_diff", "incomplete_checkpoints", "is_hf_directory", "list_checkpoints",
           "load_pickle_safely", "load_tensors", "newest_intact", "read_full", "read_meta", "resolve_load_path",
           "run_of", "save_checkpoint", "unreadable_file"]
