"""Hugging Face checkpoint directories for our model: `load_hf(path, layout="auto")` and `save_hf(model, path, layout)`.

What a directory holds (`config.json`, `model.safetensors` or shards listed by `model.safetensors.index.json`), the
config.json <-> ModelConfig mapping and the whole-file `read_checkpoint` / `write_checkpoint` live in
interop.directory (re-exported here). Layouts: "kimi_linear" (interop.kimi_linear) and "k3" (interop.k3_layout,
routed experts in packed MXFP4). A model config given to `load_hf` must agree with the checkpoint's config.json on
every architectural key; otherwise ConfigMismatchError lists each differing key with both values. `load_hf` streams
the tensors into the model (interop.sharded_load), which also serves the ranks of a parallel layout.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..annotations import meta
from ..model import causal_lm_class
from ..model.experts import GroupedExperts
from . import kimi_linear
from .directory import (
    DEFAULT_MAX_SHARD_SIZE,
    LAYOUTS,
    ConfigMismatchError,
    checkpoint_keys,
    config_differences,
    config_from_hf,
    detect_layout,
    dtype_of,
    read_checkpoint,
    read_model_config,
    write_checkpoint,
)
from .family import family
from .k3_experts import export_scale_mode
from .sharded_load import load_hf_sharded

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ model API
def load_hf(path, layout: str = "auto", config=None, vision: bool | None = None):
    """A K3ForCausalLM with the weights of a Hugging Face directory, or a K3ForConditionalGeneration where the K3
    directory has a vision tower (config.json `vision_config` and the tower's tensors). `config`: the ModelConfig
    the caller expects (its non-architectural knobs, e.g. moe_overflow, are kept); it must agree with config.json,
    or ConfigMismatchError names every differing key. Without it the model is built from config.json. `vision`:
    None = as `config`, else as the directory holds (directory.read_model_config: a vision_config without vision
    tensors loads the text model); False = the text model only, the vision config ignored and the vision tensors
    skipped with one log line.

    The tensors stream into the model (interop.sharded_load.load_hf_sharded: a memory map per shard file, never a whole
    state dict in memory); a Kimi Linear directory in transformers' in-memory naming is read whole."""
    path = Path(path)
    if vision is None and config is not None:
        vision = config.vision.enabled
    file_cfg, layout = read_model_config(path, layout, vision)
    if config is not None:
        diffs = config_differences(config, file_cfg)
        if diffs:
            raise ConfigMismatchError(path, diffs)
    cfg = config or file_cfg
    if vision and not cfg.vision.enabled:
        raise ValueError(f"{path}: vision=True but the given model config has no vision tower")
    model = causal_lm_class(cfg)(cfg, init=False)
    if family(layout).naming_problem(checkpoint_keys(path)):  # transformers' in-memory naming: read whole
        _, tensors = read_checkpoint(path)
        model.load_state_dict(kimi_linear.from_hf_state_dict(tensors, cfg), strict=True)
        n = len(tensors)
    else:
        n = load_hf_sharded(model, path, layout, group=None).tensors
    log.info("loaded %s (%s layout, %d tensors)", path, layout, n)
    return model


def checkpoint_model_config(path):
    """The ModelConfig load_hf builds for Hugging Face directory `path` (directory.read_model_config): what
    model=from_checkpoint composes (config.compose takes this function as its model reader)."""
    return read_model_config(path)[0]


def save_hf(model, path, layout: str = "k3", dtype=None, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
            scale_mode: str | None = None):
    """Write `model` (unsharded: tensor and expert parallel size 1) as a Hugging Face directory.

    layout "k3": non-expert tensors in `dtype` (default bfloat16, as the released checkpoint) except the fp32 ones
    (conv, A_log, dt_bias, o_norm, router bias); routed experts as packed MXFP4 + E8M0 scales, quantised with
    `scale_mode` (default: the model's QAT weight mode, else floor).
    layout "kimi_linear": every tensor in `dtype` (default: as the model holds it), the same fp32 ones kept fp32.
    Returns the directory."""
    fam = family(layout)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    if any(meta(p).tp_dim is not None or meta(p).expert_parallel for p in model.parameters()):
        raise ValueError("save_hf needs an unsharded model (tensor and expert parallel size 1); gather the "
                         "shards into one process first")
    cfg = model.cfg
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    dt = dtype_of(dtype) or fam.default_dtype
    mode = export_scale_mode(experts[0], scale_mode) if experts else "floor"
    loaded = {int(n.split(".")[2]): m.loaded_scales for n, m in model.named_modules()
              if isinstance(m, GroupedExperts) and getattr(m, "loaded_scales", None)}
    tensors = fam.tensors_of(sd, cfg, dt, mode, loaded)
    write_checkpoint(path, tensors, fam.config_dict(cfg, dt or next(iter(sd.values())).dtype), max_shard_size)
    log.info("wrote %s (%s layout, %d tensors)", path, layout, len(tensors))
    return Path(path)


__all__ = ["load_hf", "save_hf", "checkpoint_model_config", "read_checkpoint", "write_checkpoint", "detect_layout",
           "config_from_hf", "config_differences", "ConfigMismatchError", "LAYOUTS"]
