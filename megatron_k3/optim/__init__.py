"""Optimizers and learning-rate schedules: `build_optimizer(model, optim_cfg)` makes AdamW or Per-Head Muon."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .muon import (MUON_ANNOTATIONS, Muon, QKClip, grouping_table, log_grouping, muon_param_groups, muon_rule,
                   newton_schulz)


def _named(model, params):
    return list(model.named_parameters()) if params is None else list(params)


def adamw_param_groups(model: torch.nn.Module | None, weight_decay: float, params=None) -> list:
    """optim=adamw: weight decay on every matrix except the embedding, none on 1-D parameters. `params`:
    (name, parameter) pairs to group instead of all of `model`'s."""
    decay, no_decay = [], []
    for n, p in _named(model, params):
        (decay if p.ndim >= 2 and "embed_tokens" not in n else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, "rule": "adamw/decay"},
            {"params": no_decay, "weight_decay": 0.0, "rule": "adamw/no_decay"}]


def _data_parallel_group():
    """The group QK-Clip reduces its max logits over: parallel.state's DP group, else the whole world."""
    from ..parallel import state

    if not dist.is_initialized():
        return None
    return state.get_data_parallel_group() if state.model_parallel_is_initialized() else dist.group.WORLD


def build_optimizer(model: torch.nn.Module | None, cfg, zero: bool = False, params=None,
                    what: str = "") -> torch.optim.Optimizer:
    """The optimizer `cfg` (an OptimConfig) asks for, over all of `model`'s parameters (or the (name,
    parameter) pairs `params`), and its grouping logged on rank 0 (titled with `what`). optim=adamw:
    torch.optim.AdamW. optim=muon: Per-Head Muon + AdamW (optim/muon.py), with QK-Clip over `model`'s
    attention when cfg.qk_clip > 0 and a model is given; with `zero=True` the DeepSpeed ZeRO-1/2 variant,
    which needs `megatron_k3.optim.zero.attach(engine)` after `deepspeed.initialize` (optim/zero.py)."""
    title = f" {what}" if what else ""
    if cfg.name == "adamw":
        groups = adamw_param_groups(model, cfg.weight_decay, params)
        log_grouping("adamw" + title, groups)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)
    if cfg.name != "muon":
        raise ValueError(f"unknown optimizer {cfg.name!r}; valid: adamw, muon")
    from ..parallel.layers import current_tp

    groups = muon_param_groups(model, cfg, params)
    log_grouping(("muon (per-head)" if cfg.per_head else "muon (whole matrices)") + title, groups)
    qk_clip = QKClip(model, cfg.qk_clip, _data_parallel_group()) if cfg.qk_clip > 0 and model is not None else None
    if zero:
        from .zero import ZeroMuon

        return ZeroMuon(groups, tp=current_tp(), qk_clip=qk_clip)
    return Muon(groups, tp=current_tp(), qk_clip=qk_clip)


__all__ = ["build_optimizer", "adamw_param_groups", "Muon", "QKClip", "muon_param_groups", "muon_rule",
           "newton_schulz", "grouping_table", "MUON_ANNOTATIONS"]
