"""Checkpoint layouts of other stacks (Hugging Face Kimi Linear, Kimi K3): `load_hf(path)` and `save_hf(model, path,
layout=...)` are the entry points (interop.hf); `load_hf_sharded(model, path)` / `save_hf_sharded(model, path,
tp_group=...)` read and write the same directories from the ranks of a parallel layout, each rank only its part
(interop.sharded_load, interop.sharded_save; `wider_than_module`: the parameters a layout stores wider than the
module holds them, whose fp32 masters an export writes). `checkpoint_model_config(path)`: the ModelConfig of a
directory's config.json (model=from_checkpoint); `copy_tokenizer_files(src, dst)`: the tokenizer and chat files an
export takes along. What differs between the two checkpoint families is interop.family."""

from .directory import CheckpointReadError, MissingShardError, copy_tokenizer_files, read_model_config
from .hf import checkpoint_model_config, load_hf, save_hf
from .sharded_load import LoadReport, load_hf_sharded
from .sharded_save import CheckpointWriteError, save_hf_sharded, wider_than_module

__all__ = ["load_hf", "save_hf", "load_hf_sharded", "save_hf_sharded", "LoadReport", "CheckpointReadError",
           "MissingShardError", "CheckpointWriteError", "checkpoint_model_config", "read_model_config",
           "copy_tokenizer_files", "wider_than_module"]
