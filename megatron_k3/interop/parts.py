"""What the ranks of a parallel layout share when they read or write a Hugging Face directory together: the
process group (`resolve_group`), every rank's value (`gather_all`), one outcome for all (`agree`: the first rank's
error raised on every rank), and the model's distinct tensors (`targets`, with `EXPERT` naming the routed experts'
stacked matrices)."""

from __future__ import annotations

import re

import torch.distributed as dist

from ..parallel.agree import gather
from .directory import CheckpointReadError, MissingShardError

EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(w[123])")

__all__ = ["EXPERT", "resolve_group", "rank_and_size", "gather_all", "agree", "targets"]


def resolve_group(group):
    """"auto": the default process group when torch.distributed is initialised, else none (this process alone)."""
    if group == "auto":
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return group


def rank_and_size(group) -> tuple:
    return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)


def gather_all(obj, group) -> list:
    """Every rank's `obj` in `group` (None: this process alone)."""
    return gather(obj, group) if group is not None else [obj]


def agree(err: BaseException | None, group, extra=None, other=CheckpointReadError) -> list:
    """Every rank's `extra`; raises, on every rank, the first rank's error (this rank's own exception where it is
    that one, else `other`, or MissingShardError for a missing file, with its message)."""
    payload = (None if err is None else (str(err), isinstance(err, FileNotFoundError)), extra)
    out = gather_all(payload, group)
    first = next((e for e, _ in out if e is not None), None)
    if first is not None:
        message, missing = first
        if err is not None and str(err) == message:
            raise err
        raise (MissingShardError if missing and other is CheckpointReadError else other)(message)
    return [x for _, x in out]


def targets(model):
    """(name, tensor) of every distinct parameter and persistent buffer of the model, in state-dict order."""
    seen = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            yield name, t
