"""`parallelize(model, groups)`: every kind of parallelism applied to a built single-device K3 model from outside,
each by the module that owns it, with the process groups passed in (never read from globals):

1. pipeline: the model keeps its stage (`pipeline.cut_stage`), first, so nothing below touches other stages;
2. tensor + sequence: layer substitution, region entries, partial-gradient hooks (`tensor`);
3. expert: each EP rank's block of experts and the dispatcher's all-to-all, TP's token split (`experts`);
4. context: input sharding, op substitution in KDA and MLA, the loss's share (`context`).

`build_model(cfg, groups, device, dtype, seed)` is how a run gets its model: the rank's part (its pipeline stage's
layers) is constructed on the meta device, parallelised there (tensor-parallel shards, its block of experts: views
of meta tensors, nothing allocated), then allocated on `device` at the rank's own sizes and initialised shard-locally
(K3ForCausalLM.materialize): no tensor of another stage, and no parameter at its full size where the rank holds a
shard, ever exists on the rank. `parallelize` also takes an initialised, unsharded model (tests compare layouts
that way): the values are the same, as the initial weights do not depend on the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..model.k3 import K3ForCausalLM
from ..model.multimodal import causal_lm_class
from .context import apply_context_parallel
from .experts import apply_expert_parallel
from .mappings import Group
from .pipeline import cut_stage, stage_part
from .tensor import TensorParallel, apply_tensor_parallel

__all__ = ["ParallelGroups", "parallelize", "build_model"]


@dataclass(frozen=True)
class ParallelGroups:
    """The groups one rank's model is parallelised over (all of size 1: the single-device model)."""
    tp: TensorParallel = field(default_factory=TensorParallel)
    ep: Group = field(default_factory=Group)
    cp: Group = field(default_factory=Group)
    pp: Group = field(default_factory=Group)

    @classmethod
    def from_state(cls, ps, sequence_parallel: bool = False) -> "ParallelGroups":
        """This rank's groups from a parallel.state.ParallelState; sequence parallelism only where tp > 1."""
        def g(name):
            return Group(ps.group(name), ps.size(name), ps.rank_in(name))

        tp = g("tp")
        return cls(tp=TensorParallel(tp.group, tp.size, tp.rank, sequence_parallel and tp.size > 1), ep=g("ep"),
                   cp=g("cp"), pp=g("pp"))


def parallelize(model: nn.Module, groups: ParallelGroups, redundant_experts: int | None = None) -> nn.Module:
    """`model` parallelised over `groups`, in place; returns it. A K3ForCausalLM takes every kind; a part of one (a
    decoder layer, a MoE block) takes tensor and expert parallelism, which act on its modules alone.
    `redundant_experts`: moe.redundant_experts (replica slots per EP rank of balanced dispatch; None: E/ep)."""
    whole = isinstance(model, K3ForCausalLM)
    if not whole and (groups.pp.size > 1 or groups.cp.size > 1):
        raise TypeError(f"pipeline and context parallelism cut a whole K3ForCausalLM, not a {type(model).__name__}")
    if whole:
        cut_stage(model, groups.pp.size, groups.pp.rank)
    apply_tensor_parallel(model, groups.tp)
    apply_expert_parallel(model, groups.tp, groups.ep, redundant_experts)
    if whole:
        apply_context_parallel(model, groups.cp)
    return model


def build_model(cfg, groups: ParallelGroups, device="cpu", dtype: torch.dtype | None = None,
                seed: int | None = 0, redundant_experts: int | None = None) -> K3ForCausalLM:
    """This rank's model over `groups` (a K3ForConditionalGeneration where model.vision.enabled): its pipeline stage
    built on the meta device, parallelised there, then (unless
    `device` is "meta") allocated on `device` with parameters in `dtype` (default fp32) and initialised from `seed`
    shard-locally, so every layout starts from the single-process weights of that seed."""
    with torch.device("meta"):
        model = causal_lm_class(cfg)(cfg, init=False, **stage_part(cfg, groups.pp.size, groups.pp.rank))
    parallelize(model, groups, redundant_experts)
    if torch.device(device).type == "meta":
        return model
    return model.materialize(device, dtype, seed)
