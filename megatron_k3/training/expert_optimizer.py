"""The routed experts' optimizer under expert parallelism (ep > 1), outside DeepSpeed, sharded over expert data
parallelism, and the global gradient norm that includes them."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..annotations import copy_meta, full_shape, shard_offsets
from ..layout import expert_block
from ..ops.numerics import sq_norm64
from ..optim.zero import ZeroMuon, clip_coefficient
from ..parallel.mappings import all_gather_single, reduce_scatter_single


class ExpertOptimizer:
    """The routed experts under expert parallelism (ep > 1), outside DeepSpeed, their optimizer states sharded over
    the expert-data-parallel group (the ranks holding the same experts) as ZeRO-1/2 shards the dense ones.

    DeepSpeed's ZeRO flattens and reduces every parameter it manages over the dense data-parallel group, which
    would add expert e of one EP rank to expert e + E/ep of another. So the local experts get their own
    optimizer of the same kind. Each edp rank owns a block of whole local experts (`layout.expert_block`: ceil(E/edp)
    of this EP rank's E, the last blocks shorter or empty) and keeps fp32 master copies and optimizer states of that
    block only; the masters carry the parameters' annotations, so with optim=muon each expert is its own matrix,
    orthogonalised whole, as in one process. Micro-batch gradients accumulate in fp32, as DeepSpeed's (its
    `grad_accum` attribute) and Megatron's (main_grad) do for the parameters they hold: with weights in a narrower
    dtype each parameter's gradient is added to an fp32 accumulator as soon as autograd has accumulated it, and
    dropped (`_accumulate`); with precision.grad_accum_dtype=bf16 they accumulate in the weights' dtype, as
    DeepSpeed's then do. After the last micro-batch's backward each expert's gradient is reduce-scattered in fp32
    over edp to its owner's block and divided by the dense DP size -- each expert has received the tokens of every
    DP replica in its EP group, so the sum over EDP covers the global batch once -- and clipped by the same global
    norm as the dense parameters (`install_norm`), with the same coefficient (`optim.zero.clip_coefficient`), before
    the optimizer's momentum sees it. After the step every edp rank's updated block is all-gathered in the
    parameters' dtype."""

    def __init__(self, named_params, make_optimizer, ps, device, fp32_accumulation: bool = True):
        """`ps`: the rank's parallel.state.ParallelState (its expert-data-parallel, EP, DP and pipeline groups);
        `device`: the model's (the gradient norm's, also on a pipeline stage without routed experts, which has
        nothing to step but joins the norm's collectives); `fp32_accumulation`: precision.grad_accum_dtype=fp32.

        The masters are blocks of their parameters: their annotation is the parameter's (so Muon groups them the
        same way), but where a block sits in the unsharded tensor is `placement`, not annotations.full_shape /
        shard_offsets of the master."""
        self.params = [p for _, p in named_params]
        self.names = [n for n, _ in named_params]
        self.edp_group, self.ep_group, self.pp_group = ps.group("edp"), ps.group("ep"), ps.group("pp")
        self.edp, self.ep, self.dp, self.pp = ps.size("edp"), ps.size("ep"), ps.size("dp"), ps.size("pp")
        # (start, count) along dimension 0 (the local experts) of the block of each parameter this rank steps
        self.blocks = [expert_block(p.shape[0], self.edp, ps.rank_in("edp")) for p in self.params]
        # fp32 masters of the block, annotated like their parameters, so they are grouped and stepped the same way
        self.masters = [copy_meta(p, p.detach()[s:s + n].float().clone().requires_grad_(True))
                        for p, (s, n) in zip(self.params, self.blocks)]
        self.optimizer = make_optimizer(list(zip(self.names, self.masters))) if self.params else _NothingToStep()
        self.device = device
        self.sq_norm = torch.zeros((), dtype=torch.float64)
        # the step's fp32 gradient of each parameter held in a narrower dtype (None before its first backward)
        self.main_grads = [None] * len(self.params)
        # on every parameter: DeepSpeed casts the module to its weights' dtype after this is built. The parameters
        # name their optimizer: a hook of an earlier one over the same parameters steps aside instead of taking the
        # gradients into its own accumulators
        for p in self.params:
            p._expert_optimizer = self
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._accumulate, i))
                       for i, p in enumerate(self.params)] if fp32_accumulation else []

    def _accumulate(self, i: int, p: torch.Tensor) -> None:
        """Autograd has accumulated a backward's gradient of parameter i into p.grad (in p's dtype): add it to the
        step's fp32 accumulator and drop it, so a bf16 gradient lives one tensor at a time and the micro-batches'
        sum is fp32 (what one backward sums before this, e.g. the tiles of a tiled MoE block, autograd sums in p's
        dtype). fp32 weights accumulate in p.grad."""
        if p.grad is None or p.grad.dtype == torch.float32 or getattr(p, "_expert_optimizer", None) is not self:
            return
        g, p.grad = p.grad, None
        if self.main_grads[i] is None:
            self.main_grads[i] = g.float()
        else:
            self.main_grads[i].add_(g)

    def _gradient(self, i: int) -> torch.Tensor:
        """Parameter i's fp32 gradient of the step (zeros if it had none), taken from its accumulator and p.grad
        (fp32 weights accumulate there; balanced dispatch's `flush` adds the replicas' gradients there after the
        last backward), both dropped."""
        p, acc = self.params[i], self.main_grads[i]
        self.main_grads[i] = None
        g = acc if acc is not None else torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if p.grad is not None:
            g = g.add_(p.grad) if acc is not None else p.grad.float()
        p.grad = None
        return g

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def placement(self, i: int) -> tuple:
        """(global shape, offsets) of master i in its unsharded tensor: the parameter's EP (and TP) block, moved
        along the experts by the start of this rank's block."""
        p, (start, _) = self.params[i], self.blocks[i]
        offsets = list(shard_offsets(p))
        offsets[0] += start
        return full_shape(p), tuple(offsets)

    def _padded(self, p: torch.Tensor) -> tuple:
        """(rows per edp rank: the first, largest block; the local experts padded to edp of them)."""
        per = expert_block(p.shape[0], self.edp, 0)[1]
        return per, per * self.edp

    def whole(self, i: int, block: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A block of parameter i (its master, or an optimizer state of it) gathered over edp: every local expert of
        this EP rank, in `dtype` (default: the block's). A collective of the edp group."""
        dtype = dtype or block.dtype
        if self.edp == 1:
            return block.to(dtype)
        p = self.params[i]
        per, rows = self._padded(p)
        mine = torch.zeros((per,) + tuple(p.shape[1:]), dtype=dtype, device=block.device)
        mine[:block.shape[0]] = block
        out = torch.empty((rows,) + tuple(p.shape[1:]), dtype=dtype, device=block.device)
        all_gather_single(out, mine, group=self.edp_group)
        return out[:p.shape[0]]

    @torch.no_grad()
    def reduce_gradients(self):
        """After the last micro-batch's backward: gradients of the global batch into the fp32 masters of this rank's
        blocks, and their squared norm over every expert (summed over the expert-data-parallel, EP and pipeline
        groups: each rank's blocks are different experts). The norm stays on the experts' device: NCCL all-reduces
        device tensors only (and a host copy per expert would wait for the device each time)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (p, m, (_, n)) in enumerate(zip(self.params, self.masters, self.blocks)):
            g = self._gradient(i)
            if self.edp > 1:
                per, rows = self._padded(p)
                if rows > g.shape[0]:
                    g = torch.cat([g, g.new_zeros((rows - g.shape[0],) + tuple(g.shape[1:]))])
                mine = g.new_empty((per,) + tuple(g.shape[1:]))
                reduce_scatter_single(mine, g.contiguous(), group=self.edp_group)
                g = mine[:n]
            m.grad = g.div_(self.dp)
            sq += sq_norm64(m.grad)
        # every block, every EP rank's experts, every stage's
        for group, size in ((self.edp_group, self.edp), (self.ep_group, self.ep), (self.pp_group, self.pp)):
            if size > 1:
                dist.all_reduce(sq, group=group)
        self.sq_norm = sq

    def skip(self):
        """A step skipped for non-finite gradients: drop them, wherever they are."""
        for m in self.masters:
            m.grad = None
        for p in self.params:
            p.grad = None
        self.main_grads = [None] * len(self.params)

    @torch.no_grad()
    def step(self, total_norm: float, clip: float):
        coef = clip_coefficient(total_norm, clip)  # the coefficient the dense parameters got
        if coef != 1.0:
            for m in self.masters:
                m.grad.mul_(coef)
        self.optimizer.step()
        for m in self.masters:
            m.grad = None
        self.publish()

    @torch.no_grad()
    def publish(self):
        """Every parameter from the masters: each edp rank's block, all-gathered over edp in the parameter's dtype."""
        for i, (p, m) in enumerate(zip(self.params, self.masters)):
            p.copy_(self.whole(i, m, p.dtype))


class _NothingToStep:
    """The optimizer of a pipeline stage without routed experts (torch's refuse an empty parameter list): no groups,
    no states, a step that does nothing."""

    def __init__(self):
        self.param_groups, self.state = [], {}

    def step(self):
        pass


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
