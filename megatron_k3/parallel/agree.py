"""Ranks agreeing on an outcome before they go on: every rank's value gathered (`gather`), and the first rank's
failure learned by all (`first_failure`), so that a failure on one rank (a file it alone reads) stops every rank with
the same message instead of leaving the others to hang in their next collective."""

from __future__ import annotations

import torch.distributed as dist


def gather(obj, group=None) -> list:
    """Every rank's `obj` of `group` (None: the default group when torch.distributed runs, else this process
    alone), in rank order; a collective, so also a barrier."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def first_failure(err, group=None):
    """(rank in `group`, error) of the lowest rank whose `err` is not None, or None: every rank learns it."""
    return next(((i, e) for i, e in enumerate(gather(err, group)) if e is not None), None)
