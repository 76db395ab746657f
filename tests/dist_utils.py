"""Run a function on N gloo worker processes and hand each rank's result back to the test.

    results = run_distributed(fn, world_size, *args, timeout=120)   # results[rank] = fn(rank, world, *args)

``fn`` must be a module-level function (workers import it by name) and return something picklable. Workers
start from a fork server that has already imported torch, DeepSpeed and our training stack, so a start costs a
fork rather than a fresh interpreter and ~2 s of imports. Each worker sets MASTER_ADDR/MASTER_PORT (a free
port found by binding port 0 on 127.0.0.1), RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, one intra-op
thread, and calls ``init_process_group("gloo")``. An exception on any rank is raised in the parent as
``DistributedError`` carrying every failed rank and its traceback; ranks still running after a failure get a
short grace period and are then killed, as are all of them at the hard ``timeout``, so a wrong group shows up
as a failed test, never as a hung suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta

_CTX = None
GRACE_S = 5.0  # after one rank fails, how long the others get to finish or fail on their own
# Imported once by the fork server so workers inherit them: torch, its process groups, and the dynamo
# stack that every torch.optim optimizer imports on construction (seconds per worker otherwise).
# DeepSpeed and our training stack as well: ~1.9 s a worker otherwise (a file of training worlds: 98 s -> 77 s).
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "deepspeed", "megatron_k3.training.loop",
           "megatron_k3.config.compose")


class DistributedError(RuntimeError):
    """One or more worker ranks failed; ``errors`` maps rank -> (exception type name, message, traceback)."""

    def __init__(self, errors: dict, note: str = ""):
        self.errors = errors
        parts = [f"rank {r} raised {t}: {m}\n{tb}" for r, (t, m, tb) in sorted(errors.items())]
        super().__init__((note + "\n" if note else "") + "\n".join(parts))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(list(PRELOAD))
    return _CTX


def _worker(fn, rank, world_size, port, timeout, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """``[fn(rank, world_size, *args) for every rank]``, each on its own gloo process."""
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, timeout)
        except DistributedError as e:
            # The free port was taken between finding it and rank 0 binding it: try another.
            if attempt == 2 or not any("address already in use" in m.lower() or "EADDRINUSE" in m
                                       for _, m, _ in e.errors.values()):
                raise
    raise AssertionError("unreachable")


def _run_once(fn, world_size, args, timeout):
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, timeout, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outs, errors = {}, {}
    deadline = time.monotonic() + timeout
    note = ""
    try:
        while len(outs) + len(errors) < world_size:
            now = time.monotonic()
            if now > deadline:
                silent = [r for r in range(world_size) if r not in outs and r not in errors]
                note = (f"ranks {silent} gave no result within {GRACE_S:.0f} s of the first failure; killed" if errors
                        else f"timed out after {timeout:.0f} s; ranks {silent} gave no result and were killed")
                break
            try:
                rank, status, payload = results.get(timeout=0.1)
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    # A worker that died without reporting (killed, segfault) never will.
                    if r not in outs and r not in errors and p.exitcode is not None:
                        time.sleep(0.2)  # its message may still be in the pipe
                        if results.empty():
                            errors[r] = ("ProcessExit", f"exited with code {p.exitcode} without a result", "")
                continue
            if status == "ok":
                outs[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                deadline = min(deadline, time.monotonic() + GRACE_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()
    if errors or note:
        if note and not errors:
            errors = {r: ("Timeout", "no result", "") for r in range(world_size) if r not in outs}
        raise DistributedError(errors, note)
    return [outs[r] for r in range(world_size)]
