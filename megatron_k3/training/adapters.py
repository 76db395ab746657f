"""peft=lora in the Trainer (megatron_k3.peft does the adapting): what is checked before anything is allocated, and
the adapters applied to this rank's built model.

The frozen base comes from checkpoint.directory.peft_base_directory: peft.base, else checkpoint.load where that is a
Hugging Face directory, else, on a resume, the base recorded in the checkpoint's meta.json (`peft.base` there), so a
restarted command with checkpoint.load=auto re-reads the same frozen weights; with none at all, the initialised model,
its experts encoded to MXFP4 (tests, and trying the mechanics without the release).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..config import ConfigError, RunConfig
from ..errors import one_line
from ..interop.directory import CheckpointReadError, read_index
from ..layout import has_moe
from ..model.multimodal import causal_lm_class
from ..peft import apply_lora, check_targets, check_tokens
from .checkpoint.directory import peft_base_directory

log = logging.getLogger("megatron_k3.train")

__all__ = ["check", "apply"]


def _check_mxfp4(run: RunConfig, key: str, path: Path) -> None:
    """The base stores its routed experts as MXFP4 codes (K3 layout), which peft=lora keeps frozen as they are."""
    if not has_moe(run.model):
        return
    try:
        names, _ = read_index(path)
    except (CheckpointReadError, OSError) as e:
        raise ConfigError(key, str(path), one_line(e)) from None
    if not any(n.endswith(".weight_packed") for n in names):
        raise ConfigError(key, str(path), "peft=lora keeps the routed experts frozen as MXFP4 codes, and this "
                          "directory stores them dense: convert it to the K3 layout first (tools/convert_checkpoint.py"
                          " --to-hf --layout k3)")


def check(run: RunConfig) -> None:
    """Before anything is allocated, on every rank: the targets against the model (built on the meta device: each
    names a module, the rank fits each), peft.trainable_tokens against its vocabulary, and the base directory's
    experts are MXFP4."""
    with torch.device("meta"):
        model = causal_lm_class(run.model)(run.model, init=False)
    check_targets(model, run.peft.targets, run.peft.rank)
    check_tokens(run.peft.trainable_tokens, run.model.vocab_size)
    key, path = peft_base_directory(run)
    if path is not None:
        _check_mxfp4(run, key, path)


def apply(model, run: RunConfig, groups, rank: int) -> dict:
    """The adapters on this rank's built model (megatron_k3.peft.apply_lora), logged once."""
    summary = apply_lora(model, run.peft, groups.tp, run.train.seed, whole=groups.pp.size == 1)
    if rank == 0:
        p = run.peft
        log.info("peft=lora rank %d alpha %g on %s (%d trainable token rows): %d modules adapted; rank 0 trains "
                 "%.3fM adapter parameters over %.3fM frozen (%.1f MB, routed experts as MXFP4)", p.rank, p.alpha,
                 ",".join(map(str, p.targets)), len(check_tokens(p.trainable_tokens, run.model.vocab_size)),
                 summary["targets"], summary["trainable"] / 1e6, summary["frozen"] / 1e6, summary["frozen_bytes"] / 1e6)
    return summary
