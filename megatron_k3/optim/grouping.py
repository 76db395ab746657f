"""Which parameters Per-Head Muon updates and how, and which take AdamW: one rule (`muon_rule`), read off each
parameter's annotation (megatron_k3.annotations), used by the optimizer and by the planner alike.

Legend: N independent matrices of a batch (heads or experts), A rows, B columns.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..annotations import meta

log = logging.getLogger("megatron_k3.optim")


def _named(model, params):
    return list(model.named_parameters()) if params is None else list(params)


def adamw_decays(name: str, p: torch.Tensor) -> bool:
    """optim=adamw's rule: weight decay on every matrix except the embedding, none on 1-D parameters."""
    return p.ndim >= 2 and "embed_tokens" not in name


def adamw_param_groups(model: torch.nn.Module | None, weight_decay: float, params=None) -> list:
    """optim=adamw: two groups by `adamw_decays`. `params`: (name, parameter) pairs to group instead of all of
    `model`'s."""
    decay, no_decay = [], []
    for n, p in _named(model, params):
        if not p.requires_grad:  # frozen (model.freeze_vision): no update, no state
            continue
        (decay if adamw_decays(n, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, "rule": "adamw/decay"},
            {"params": no_decay, "weight_decay": 0.0, "rule": "adamw/no_decay"}]


def muon_rule(p: torch.nn.Parameter, per_head: bool = True) -> str:
    """Which update a parameter gets, from its annotation and shape (first match wins):
    adamw/<reason> for an `adamw_reason` (embedding, lm_head, attn_res_query); adamw/vector for 1-D;
    muon/expert for `batched` (routed experts [E, A, B], one matrix each); adamw/not_matrix for any other
    non-matrix (depthwise conv filters [C, 1, W]); muon/shared_expert for fused shared-expert blocks;
    muon/per_head for head blocks when per_head; muon/matrix for every other matrix (whole)."""
    m = meta(p)
    if m.adamw_reason:
        return f"adamw/{m.adamw_reason}"
    if p.ndim < 2:
        return "adamw/vector"
    if m.batched:
        return "muon/expert"
    if p.ndim != 2:
        return "adamw/not_matrix"
    kind = m.block_kind
    if kind == "experts":
        return "muon/shared_expert"
    if kind == "heads" and per_head:
        return "muon/per_head"
    return "muon/matrix"


MUON_LAYOUTS = {"muon/per_head": "blocks", "muon/shared_expert": "blocks", "muon/expert": "batched",
                "muon/matrix": "matrix"}  # a Muon rule's update layout (its param group's `layout`)


def tp_gathered(m, layout: str, tp: int) -> tuple:
    """(gather, blocks) of Muon's update of a parameter with annotations `m` in a group of `layout` on `tp` TP ranks:
    gather when the rank holds a TP shard of what must be orthogonalised whole (a matrix, or blocks the TP split
    cuts or does not share out evenly), which optim.muon then all-gathers over TP in the step; blocks: those the
    rank's orthogonalisation covers. The planner counts the gather and the whole matrix's Newton-Schulz from this."""
    n, axis, dim = m.blocks, m.block_axis, m.tp_dim
    gather = tp > 1 and dim is not None and layout != "batched"
    if gather and layout == "blocks" and dim == axis and n % tp == 0:
        return False, n // tp  # this rank holds whole blocks: local work
    return gather, n


_NO_DECAY = ("adamw/embedding", "adamw/vector")  # as optim=adamw: decay every matrix but the embedding


def muon_param_groups(model: torch.nn.Module | None, cfg, params=None) -> list:
    """One param group per rule (see `muon_rule`), in a fixed order, empty rules left out. Muon groups carry
    layout, momentum, nesterov, ns_steps, scale and ns_dtype; AdamW groups betas and eps. Every parameter
    is tagged `use_muon` (the attribute DeepSpeed's ZeRO code reads). `params`: (name, parameter) pairs to
    group instead of all of `model`'s."""
    by_rule: dict = {}
    named = model.named_parameters() if params is None else params
    for _, p in named:  # named_parameters skips a tied weight's second name
        if p.requires_grad:
            by_rule.setdefault(muon_rule(p, cfg.per_head), []).append(p)
    groups = []
    for rule in sorted(by_rule, key=lambda r: (not r.startswith("muon"), r)):
        params = by_rule[rule]
        use_muon = rule.startswith("muon/")
        for p in params:
            p.use_muon = use_muon
        g = {"params": params, "rule": rule, "use_muon": use_muon, "lr": cfg.lr,
             "weight_decay": 0.0 if rule in _NO_DECAY else cfg.weight_decay}
        if use_muon:
            g.update(layout=MUON_LAYOUTS[rule], momentum=cfg.momentum, nesterov=cfg.nesterov, ns_steps=cfg.ns_steps,
                     scale=cfg.muon_scale, ns_dtype=cfg.ns_dtype)
        else:
            g.update(betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        groups.append(g)
    return groups


def grouping_table(groups: list) -> str:
    """The grouping as an aligned text table: rule, tensors, parameters, weight decay."""
    rows = [(g.get("rule", f"group {i}"), len(g["params"]), sum(p.numel() for p in g["params"]),
             g.get("weight_decay", 0.0)) for i, g in enumerate(groups)]
    total = sum(r[2] for r in rows) or 1
    lines = [f"  {'rule':<24}{'tensors':>8}{'parameters':>14}{'share':>8}{'decay':>8}"]
    lines += [f"  {r:<24}{n:>8}{k:>14,}{k / total:>8.1%}{wd:>8g}" for r, n, k, wd in rows]
    return "\n".join(lines)


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def log_grouping(name: str, groups: list):
    if _is_rank0():
        log.info("optimizer %s: parameter grouping\n%s", name, grouping_table(groups))


__all__ = ["muon_rule", "MUON_LAYOUTS", "tp_gathered", "muon_param_groups", "adamw_decays", "adamw_param_groups",
           "grouping_table", "log_grouping"]
