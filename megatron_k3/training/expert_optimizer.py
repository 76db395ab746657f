"""The routed experts' optimizer under expert parallelism (ep > 1), outside DeepSpeed, and the global gradient norm
that includes them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..annotations import copy_meta
from ..optim.zero import ZeroMuon, clip_coefficient


class ExpertOptimizer:
    """The routed experts under expert parallelism (ep > 1), outside DeepSpeed.

    DeepSpeed's ZeRO flattens and reduces every parameter it manages over the dense data-parallel group, which
    would add expert e of one EP rank to expert e + E/ep of another. So the local experts get their own
    optimizer of the same kind (fp32 master copies, which carry the parameters' Muon annotations: with
    optim=muon each local expert is its own matrix, as in one process): their gradients are summed over the
    expert-data-parallel group (ranks holding the same experts) and divided by the dense DP size -- each
    expert has received the tokens of every DP replica in its EP group, so the sum over EDP covers the global
    batch once -- and they are clipped by the same global norm as the dense parameters (`install_norm`),
    with the same coefficient (`optim.zero.clip_coefficient`), before the optimizer's momentum sees them."""

    def __init__(self, named_params, make_optimizer, ps):
        """`ps`: the rank's parallel.state.ParallelState (its expert-data-parallel, EP, DP and pipeline groups)."""
        self.params = [p for _, p in named_params]
        self.names = [n for n, _ in named_params]
        # fp32 masters annotated like their parameters, so they are grouped and stepped the same way
        self.masters = [copy_meta(p, p.detach().float().clone().requires_grad_(True)) for p in self.params]
        self.optimizer = make_optimizer(list(zip(self.names, self.masters)))
        self.edp_group, self.ep_group, self.pp_group = ps.group("edp"), ps.group("ep"), ps.group("pp")
        self.dp, self.pp = ps.size("dp"), ps.size("pp")
        self.sq_norm = torch.zeros((), dtype=torch.float64)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @torch.no_grad()
    def reduce_gradients(self):
        """After the last micro-batch's backward: gradients of the global batch into the fp32 masters, and
        their squared norm over every expert (summed over the EP group: each rank holds different experts). The norm
        stays on the experts' device: NCCL all-reduces device tensors only (and a host copy per expert would wait
        for the device each time)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.masters[0].device if self.masters else None)
        for p, m in zip(self.params, self.masters):
            g = torch.zeros_like(m) if p.grad is None else p.grad.float()
            if dist.get_world_size(self.edp_group) > 1:
                dist.all_reduce(g, group=self.edp_group)
            m.grad = g.div_(self.dp)
            sq += m.grad.double().pow(2).sum()
            p.grad = None
        if dist.get_world_size(self.ep_group) > 1:
            dist.all_reduce(sq, group=self.ep_group)
        if self.pp > 1:  # every stage's experts
            dist.all_reduce(sq, group=self.pp_group)
        self.sq_norm = sq

    def skip(self):
        """A step skipped for non-finite gradients: drop them."""
        for m in self.masters:
            m.grad = None

    @torch.no_grad()
    def step(self, total_norm: float, clip: float):
        coef = clip_coefficient(total_norm, clip)  # the coefficient the dense parameters got
        if coef != 1.0:
            for m in self.masters:
                m.grad.mul_(coef)
        self.optimizer.step()
        for p, m in zip(self.params, self.masters):
            m.grad = None
            p.copy_(m.to(p.dtype))


def install_norm(zero, experts: ExpertOptimizer) -> None:
    """Make DeepSpeed's global gradient norm (which it clips with) include the experts outside it; `zero`: the
    engine's ZeRO-1/2 optimizer (expert parallelism needs ZeRO)."""
    inner = zero.scaled_global_norm

    def scaled_global_norm(norm_type=2):
        dense = inner(norm_type)
        return (dense.double() ** 2 + experts.sq_norm.to(dense.device)).sqrt().to(dense.dtype)

    zero.scaled_global_norm = scaled_global_norm
    if isinstance(zero.optimizer, ZeroMuon):  # its step takes the norm itself (optim/zero.py)
        zero.optimizer.extra_sq_norm = lambda: experts.sq_norm.to(zero.bit16_groups[0][0].device)
