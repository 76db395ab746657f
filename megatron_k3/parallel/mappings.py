"""Autograd-aware collectives for tensor and sequence parallelism.

Every function takes the process group explicitly; with a group of size 1 (or None) each is the
identity, so the model is exactly the single-device model when nothing is parallel.

  copy_to_region        fwd identity            bwd all-reduce     (enter a TP region from a full tensor)
  reduce_from_region    fwd all-reduce          bwd identity       (leave a TP region, no SP)
  gather_last           fwd all-gather dim -1   bwd split dim -1   (column-parallel gather_output)
  gather_seq            fwd all-gather dim 1    bwd reduce-scatter (enter a TP region under SP)
  reduce_scatter_seq    fwd reduce-scatter d1   bwd all-gather     (leave a TP region under SP)
  split_rows            fwd keep my rows        bwd all-gather dim 0 (MoE: each TP rank routes its rows)
  gather_rows           fwd all-gather dim 0    bwd keep my rows
  all_to_all            fwd all-to-all          bwd the reverse all-to-all (expert dispatch)
  all_to_all_overlapped the same, run asynchronously around a side computation, both directions

Under torch.compile (train.compile) dynamo traces these collectives as functional collectives, and the overlapped
all-to-all is the plain one: the compiler orders the side computation around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def all_gather_single(out: torch.Tensor, x: torch.Tensor, group=None) -> None:
    """out <- every rank's x, concatenated along dimension 0 (no autograd). torch 2.13 names it all_gather_single
    and warns on all_gather_into_tensor, the device image's torch 2.11 has only the latter; looked up at each call,
    through the module attribute, as training.faults wraps them."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group=None) -> None:
    """out <- this rank's chunk along dimension 0 of x summed over the group (no autograd); the names as in
    `all_gather_single`."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, group=group)


@dataclass(frozen=True)
class Group:
    """A process group as the parallel layers use it: the group, its size and this rank's index in it. The default
    (no group, size 1) is the single-device case; a group of size > 1 without a process group describes one rank
    of a layout for bookkeeping (the planner shards modules on the meta device that way)."""
    group: object = None
    size: int = 1
    rank: int = 0

    @classmethod
    def of(cls, group) -> "Group":
        """The Group of a torch.distributed process group (None: size 1)."""
        return cls(group, _size(group), _rank(group))


def _size(group) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None or not dist.is_initialized() else dist.get_rank(group)


def _all_reduce(x, group):
    if _size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x, dim, group):
    n = _size(group)
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _parts(x, dim, group, what: str) -> int:
    """The group size n (1: nothing to do), after checking that dim of x splits into n equal parts."""
    n = _size(group)
    if n > 1 and x.shape[dim] % n:
        raise ValueError(f"cannot {what} dim {dim} of size {x.shape[dim]} over {n} ranks")
    return n


def _split(x, dim, group):
    if _parts(x, dim, group, "split") == 1:
        return x
    return x.chunk(_size(group), dim=dim)[_rank(group)].contiguous()


def _reduce_scatter(x, dim, group):
    n = _parts(x, dim, group, "reduce-scatter")
    if n == 1:
        return x
    parts = [p.contiguous() for p in x.chunk(n, dim=dim)]
    out = torch.empty_like(parts[0])
    full = torch.stack(parts)  # [n, ...]: every rank sums every chunk, then keeps its own
    if hasattr(dist, "reduce_scatter_tensor"):
        try:
            dist.reduce_scatter_tensor(out.view(1, *out.shape), full, group=group)
            return out
        except (RuntimeError, NotImplementedError):
            pass
    dist.all_reduce(full, group=group)
    return full[_rank(group)].contiguous()


def _identity(x, group):
    return x.view_as(x)


def _reduce_copy(x, group):
    return _all_reduce(x.clone(), group)


class _Collective(torch.autograd.Function):
    """One autograd pair: `fwd(x, group)` forward, `bwd(grad, group)` backward."""

    @staticmethod
    def forward(ctx, x, group, fwd, bwd):
        ctx.group, ctx.bwd = group, bwd
        return fwd(x, group)

    @staticmethod
    def backward(ctx, g):
        return ctx.bwd(g, ctx.group), None, None, None


def _pair(fwd, bwd):
    def apply(x, group):
        return x if _size(group) == 1 else _Collective.apply(x, group, fwd, bwd)
    return apply


def _last(op):
    return lambda x, group: op(x, -1, group)


def _seq(op):
    return lambda x, group: op(x, 1, group)


def _first(op):
    return lambda x, group: op(x, 0, group)


copy_to_region = _pair(_identity, _all_reduce)
reduce_from_region = _pair(_reduce_copy, _identity)
gather_last = _pair(_last(_all_gather), _last(_split))
gather_seq = _pair(_seq(_all_gather), _seq(_reduce_scatter))
reduce_scatter_seq = _pair(_seq(_reduce_scatter), _seq(_all_gather))
split_seq = _pair(_seq(_split), _seq(_all_gather))
gather_rows = _pair(_first(_all_gather), _first(_split))
split_rows = _pair(_first(_split), _first(_all_gather))


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        x = x.contiguous()
        rows = x.shape[0] if out_splits is None else sum(out_splits)
        out = x.new_empty((rows,) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        rows = g.shape[0] if ctx.in_splits is None else sum(ctx.in_splits)
        out = g.new_empty((rows,) + tuple(g.shape[1:]))
        dist.all_to_all_single(out, g, ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x, group, out_splits=None, in_splits=None):
    """Rows of x go to the ranks of `group` in order: equal blocks when the split sizes are None (static
    shapes, no host synchronisation), else `in_splits[r]` rows to rank r and `out_splits[r]` rows from it."""
    if _size(group) == 1:
        return x
    return _AllToAll.apply(x, group, out_splits, in_splits)


class _Handles:
    """The in-flight all-to-all of one overlapped exchange: forward work, backward work and its output."""
    __slots__ = ("group", "work", "bwd_work", "bwd_out")

    def __init__(self, group):
        self.group, self.work, self.bwd_work, self.bwd_out = group, None, None, None


class _AllToAllStart(torch.autograd.Function):
    """Starts the equal-split all-to-all; its backward waits for the reverse one that _AllToAllWait started."""

    @staticmethod
    def forward(ctx, x, h):
        x = x.contiguous()
        out = torch.empty_like(x)
        h.work = dist.all_to_all_single(out, x, group=h.group, async_op=True)
        ctx.h = h
        return out

    @staticmethod
    def backward(ctx, g):
        h = ctx.h
        h.bwd_work.wait()
        out, h.bwd_out, h.bwd_work = h.bwd_out, None, None
        return out, None


class _AllToAllWait(torch.autograd.Function):
    """Waits for the forward all-to-all; its backward starts the reverse all-to-all and returns at once, so
    autograd runs other ready nodes (the side computation's backward) while it is in flight."""

    @staticmethod
    def forward(ctx, y, h):
        h.work.wait()
        h.work = None
        ctx.h = h
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        h = ctx.h
        g = g.contiguous()
        h.bwd_out = torch.empty_like(g)
        h.bwd_work = dist.all_to_all_single(h.bwd_out, g, group=h.group, async_op=True)
        return h.bwd_out, None  # filled when _AllToAllStart.backward (its only consumer) has waited


def all_to_all_overlapped(x, group, side):
    """(all_to_all(x, group), side()) with `side` computed while the exchange is in flight, and in backward
    the reverse exchange in flight while autograd is free to run side's backward (autograd runs the nodes
    created later first, and side's nodes lie between the start and the wait). Equal splits only (static
    shapes). Values and gradients are those of the sequential form, bit for bit."""
    if _size(group) == 1:
        return x, side()
    if torch.compiler.is_compiling():  # compiled: a functional all-to-all the compiler schedules (no work handles)
        return all_to_all(x, group), side()
    h = _Handles(group)
    started = _AllToAllStart.apply(x, h)
    out = side()
    return _AllToAllWait.apply(started, h), out


class _GatherVarRows(torch.autograd.Function):
    """Each rank's rows [n_r, ...] -> every rank's, concatenated in rank order; backward: this rank's rows of the
    gradient (which must be the same on every rank: the gathered tensor is used alike everywhere)."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        rank = dist.get_rank(group)
        ctx.start, ctx.n = sum(sizes[:rank]), sizes[rank]
        pad = max(sizes)
        buf = x.new_zeros((pad,) + tuple(x.shape[1:]))
        buf[: x.shape[0]] = x
        parts = [torch.empty_like(buf) for _ in sizes]
        dist.all_gather(parts, buf.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, g):
        return g[ctx.start: ctx.start + ctx.n], None, None


def gather_var_rows(x, sizes: list, group):
    """`_GatherVarRows`: rows of different counts per rank (`sizes`, known on every rank) gathered in rank order."""
    return x if _size(group) == 1 else _GatherVarRows.apply(x, list(sizes), group)


class Accumulation:
    """Whether the backward that runs now is the last of its optimizer step (the gradient-accumulation boundary).
    The trainer sets `last` before each micro-batch's backward; anything else that calls backward (a single
    forward and backward, the planner's measured step) leaves it True: every backward is a whole step."""
    last = True


ACCUMULATION = Accumulation()


def all_reduce_grad_once_per_step_hook(group):
    """all_reduce_grad_hook, once per optimizer step instead of once per micro-batch: the rank's partial gradients
    of the step's micro-batches are summed locally (fp32 at least) and that sum is summed over `group` in the last
    micro-batch's backward (ACCUMULATION.last); the earlier backwards hand on zeros, so whatever accumulates the
    gradient (autograd's .grad, DeepSpeed's buffers) ends the step with the group's sum of every micro-batch's
    gradient: the per-micro-batch sum's value, summed in another order."""
    held = []

    def hook(g):
        acc = g.float() if not held else held.pop().add_(g)
        if not ACCUMULATION.last:
            held.append(acc if acc is not g else acc.clone())
            return torch.zeros_like(g)
        return _all_reduce(acc if acc is not g else acc.clone(), group).to(g.dtype)
    return hook


def all_reduce_grad_hook(group):
    """A parameter hook that sums the gradient over `group`: for replicated parameters whose gradient on each rank
    is a partial sum (they see only this rank's heads, tokens or sequence shard)."""
    def hook(g):
        return _all_reduce(g.clone(), group)
    return hook
