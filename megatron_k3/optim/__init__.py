"""Optimizers and learning-rate schedules: `build_optimizer(model, optim_cfg)` makes AdamW or Per-Head Muon.

The parameter grouping (which rule each parameter follows) is `grouping`; the Muon update and QK-Clip are `muon`;
Muon inside DeepSpeed ZeRO-1/2 is `zero` (imported by the training engine, so that importing the optimizers does
not import DeepSpeed); the LR schedule is `schedule`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.mappings import Group
from .grouping import adamw_param_groups, grouping_table, log_grouping, muon_param_groups, muon_rule
from .muon import Muon, QKClip, newton_schulz


def build_optimizer(model: torch.nn.Module | None, cfg, params=None, what: str = "", tp: Group | None = None,
                    dp_group=None, muon_class=Muon) -> torch.optim.Optimizer:
    """The optimizer `cfg` (an OptimConfig) asks for, over all of `model`'s parameters (or the (name, parameter)
    pairs `params`), and its grouping logged on rank 0 (titled with `what`). optim=adamw: torch.optim.AdamW.
    optim=muon: `muon_class` (Per-Head Muon + AdamW, or optim.zero.ZeroMuon for DeepSpeed ZeRO-1/2, which then needs
    `optim.zero.attach(engine)`), stepping tensor-parallel shards over the `tp` group the model was parallelised
    over, with QK-Clip over `model`'s attention when cfg.qk_clip > 0 and a model is given (max logits reduced over
    `dp_group`; default: the whole world when torch.distributed is up)."""
    title = f" {what}" if what else ""
    if cfg.name == "adamw":
        groups = adamw_param_groups(model, cfg.weight_decay, params)
        log_grouping("adamw" + title, groups)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)
    if cfg.name != "muon":
        raise ValueError(f"unknown optimizer {cfg.name!r}; valid: adamw, muon")
    groups = muon_param_groups(model, cfg, params)
    log_grouping(("muon (per-head)" if cfg.per_head else "muon (whole matrices)") + title, groups)
    qk_clip = None
    if cfg.qk_clip > 0 and model is not None:
        if dp_group is None and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("optim.qk_clip with several processes: pass dp_group, the data-parallel group over which "
                             "the per-head max logits are reduced (heads differ across tensor-parallel ranks)")
        qk_clip = QKClip(model, cfg.qk_clip, dp_group)
    return muon_class(groups, tp=tp, qk_clip=qk_clip)


__all__ = ["build_optimizer", "adamw_param_groups", "Muon", "QKClip", "muon_param_groups", "muon_rule",
           "newton_schulz", "grouping_table"]
