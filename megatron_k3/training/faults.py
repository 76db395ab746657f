"""Surviving faults: preemption signals, collective failures that name their group, non-finite steps.

- `Preemption`: SIGTERM (what Slurm and Kubernetes send before killing a job) and SIGUSR1 (Slurm's
  `--signal=USR1@<seconds>`) set a flag; at the end of every step the flag is OR-reduced over all ranks, so every
  rank sees the request at the same step, saves one checkpoint together and exits cleanly. A signal delivered
  to one rank only (a node being drained) stops the whole job consistently.
- `install_collective_diagnostics(ps)`: a collective that times out (`parallel.timeout_minutes`) or whose peer died
  raises `CollectiveError` naming the collective, the parallel group (tp/cp/dp/ep/pp/... of the ParallelState it
  was given) and its ranks, instead of gloo/NCCL's bare "Timed out waiting 2000ms for recv". torch.distributed's
  collectives are wrapped once per process; the wrapper costs one Python call per collective and does nothing unless
  one fails.
- `NonFiniteError` and `diagnose_nonfinite`: when too many consecutive steps had a non-finite loss or gradient,
  the run stops naming the first parameter holding a non-finite value, else the first module (in execution
  order) whose forward output is non-finite, else the first parameter whose gradient is non-finite.
"""

from __future__ import annotations

import functools
import inspect
import logging
import signal
import threading
import time

import torch
import torch.distributed as dist

from ..layout.grid import GROUPS

log = logging.getLogger("megatron_k3.faults")


class TrainingError(RuntimeError):
    """A run that cannot go on; the message says why and where (step, rank, layer, group)."""


class NonFiniteError(TrainingError):
    pass


class CollectiveError(TrainingError):
    """A collective failed (timed out, or a peer closed the connection)."""

    def __init__(self, op: str, group_desc: str, cause: BaseException, timeout: bool):
        self.op, self.group_desc, self.timeout = op, group_desc, timeout
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        what = "timed out" if timeout else "failed"
        rank = dist.get_rank() if dist.is_initialized() else 0
        super().__init__(f"rank {rank}: {op} on {group_desc} {what} ({first}); a rank of this group is stalled, "
                         f"dead or was never started (parallel.timeout_minutes sets how long to wait)")


class CollectiveTimeout(CollectiveError):
    pass


# ---------------------------------------------------------------------- preemption


class Preemption:
    """Catches SIGTERM/SIGUSR1 and turns them into a clean, checkpointed exit at the next step boundary."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self):
        self.received = None
        self._previous = {}
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (tests drive Trainers from others)
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name
        log.warning("received %s: saving a checkpoint at the end of this step, then exiting", self.received)

    def requested(self, device=None) -> bool:
        """Whether any rank received a signal (a collective over the whole world at every call)."""
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self):
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous = {}


# ---------------------------------------------------------------------- collectives

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
                "all_to_all", "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object", "scatter", "barrier",
                "send", "recv", "monitored_barrier")
_TIMEOUT_MARKS = ("timed out", "timeout")
_PEER_MARKS = ("connection closed by peer", "connection reset", "pair closure", "broken pipe", "socket closed")


_NAMED = {}  # "ps": the ParallelState whose group names a failed collective gets (install_collective_diagnostics)


def describe_group(group, ps=None) -> str:
    """'the tp group (ranks [0, 1]; the same communicator serves tp-cp)' for a process group, named by `ps` (a
    parallel.state.ParallelState; default: the one install_collective_diagnostics was last given)."""
    if not dist.is_initialized():
        return "no process group"
    if group is None or group is dist.group.WORLD:
        return f"the world group (ranks 0..{dist.get_world_size() - 1})"
    ps = ps if ps is not None else _NAMED.get("ps")
    names = [n for n in GROUPS if ps.group(n) is group] if ps is not None else []
    try:
        ranks = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        ranks = "?"
    if not names:
        return f"a group outside parallel.state (ranks {ranks})"
    also = f"; the same communicator serves {', '.join(names[1:])}" if len(names) > 1 else ""
    return f"the {names[0]} group (ranks {ranks}{also})"


def _group_arg(fn, args, kwargs):
    if "group" in kwargs:
        return kwargs["group"]
    try:
        return inspect.signature(fn).bind_partial(*args, **kwargs).arguments.get("group")
    except TypeError:
        return None


# seconds this process spent inside blocking collectives (an async one counts only its launch): train.guard's
# straggler report reads it as the time a rank waited for the others
COLLECTIVE_SECONDS = [0.0]


def _wrap(fn, op):
    @functools.wraps(fn)
    def collective(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            if isinstance(e, CollectiveError):
                raise
            msg = str(e).lower()
            timeout = any(m in msg for m in _TIMEOUT_MARKS)
            if not timeout and not any(m in msg for m in _PEER_MARKS):
                raise
            cls = CollectiveTimeout if timeout else CollectiveError
            raise cls(op, describe_group(_group_arg(fn, args, kwargs)), e, timeout) from e
        finally:
            COLLECTIVE_SECONDS[0] += time.perf_counter() - t0

    collective._k3_wrapped = True
    return collective


def install_collective_diagnostics(ps=None) -> None:
    """Wrap torch.distributed's collectives (idempotent). DeepSpeed's comm layer and our mappings call them through
    the module attribute, so they are covered too. `ps`: the rank's ParallelState, whose names a failure's group
    gets (called before it exists, then again with it: the groups are built by collectives too)."""
    if ps is not None:
        _NAMED["ps"] = ps
    for op in _COLLECTIVES:
        fn = getattr(dist, op, None)
        if fn is not None and not getattr(fn, "_k3_wrapped", False):
            setattr(dist, op, _wrap(fn, op))


# ---------------------------------------------------------------------- non-finite values


def _first_nonfinite(tensors):
    for name, t in tensors:
        if t is not None and torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all():
            return name
    return None


def _tensors(x, depth: int = 0) -> list:
    """The tensors inside a module output: tensors, tuples/lists/dicts of them, dataclass-like holders."""
    if torch.is_tensor(x):
        return [x]
    if depth > 3 or x is None:
        return []
    if isinstance(x, dict):
        items = list(x.values())
    elif isinstance(x, (tuple, list)):
        items = list(x)
    elif hasattr(x, "__dict__"):
        items = list(vars(x).values())
    else:
        return []
    return [t for i in items for t in _tensors(i, depth + 1)]


def diagnose_nonfinite(model, forward) -> str:
    """Where non-finite values start: the first parameter holding one; else the first module whose forward output
    has one (execution order); else the first parameter whose gradient has one. `forward()` runs the model on the
    batch that went wrong and returns its loss. Every rank must call this (the forward has collectives)."""
    bad = _first_nonfinite(model.named_parameters())
    if bad is not None:
        return f"parameter {bad} holds non-finite values"
    first = []

    def hook(name):
        def fn(module, inputs, output):
            if first:
                return
            if _first_nonfinite([(name, o) for o in _tensors(output)]) is not None:
                first.append(name)
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        loss = forward()
    finally:
        for h in handles:
            h.remove()
    if first:
        return f"module {first[0]} produced the first non-finite forward output"
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if torch.isfinite(loss).all():
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        bad = _first_nonfinite([(n, g) for (n, _), g in zip(named, grads)])
        if bad is not None:
            return f"the gradient of parameter {bad} is non-finite (the forward was finite)"
        return "nothing non-finite on a re-run of the last batch (a transient fault, or one on another rank)"
    return "the loss is non-finite but no module output was (the loss computation itself)"


class SkipCounter:
    """Steps skipped for non-finite values: in total, and in a row (train.max_consecutive_skips stops the run)."""

    def __init__(self):
        self.total, self.in_a_row = 0, 0

    def count(self, applied: bool, step: int, loss, grad_norm, log_it: bool) -> bool:
        """Record whether step `step` was applied; returns `applied`."""
        if applied:
            self.in_a_row = 0
            return True
        self.total += 1
        self.in_a_row += 1
        if log_it:
            log.warning("step %d: non-finite loss or gradient (loss %s, grad_norm %s): step skipped (%d in a row, "
                        "%d in total)", step, float(loss), float(grad_norm) if grad_norm is not None else None,
                        self.in_a_row, self.total)
        return False


def stop_nonfinite(model, rerun, pipeline: bool, step: int, in_a_row: int, ckpt_dir) -> None:
    """Too many skipped steps in a row: find where the non-finite values start (every rank re-runs the last bad
    batch with `rerun`, None when there is none), then raise NonFiniteError naming the first place over all ranks.
    Nothing is saved: the newest checkpoint is the last good state."""
    where = "no batch to re-run"
    if pipeline:
        where = "not diagnosed under pipeline parallelism (a stage cannot re-run the forward alone)"
    elif rerun is not None:
        where = diagnose_nonfinite(model, rerun)
    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, where)
    first = next(((r, w) for r, w in enumerate(places) if not w.startswith("nothing")), (0, places[0]))
    raise NonFiniteError(
        f"steps {step - in_a_row + 1}..{step} had non-finite loss or gradients ({in_a_row} in a row = "
        f"train.max_consecutive_skips): {first[1]} (rank {first[0]}); stopping. The newest checkpoint in "
        f"{ckpt_dir} holds the last good state.")
