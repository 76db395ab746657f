"""The training entry point with one fault injected, for the fault drills (tests/test_fault_drills.py,
bench/fault_drill.py). Same arguments as `python -m megatron_k3.train`; the fault comes from the environment:

    K3_FAULT=kill:STEP[:RANK]          SIGKILL rank RANK (default 0) right after step STEP (first attempt only:
                                       under torchrun --max-restarts the restarted workers run clean)
    K3_FAULT=sigterm:STEP[:RANK]       SIGTERM to rank RANK after step STEP (what Slurm sends before a kill)
    K3_FAULT=kill_in_save:STEP[:N]     SIGKILL in the middle of writing checkpoint STEP, after N files (default 1)
    K3_FAULT=nan:STEP[:RANK]           the loss of step STEP on rank RANK becomes NaN (a bad batch)

Nothing here changes what the trainer does; the faults are real signals to the real process (and, for nan,
a real non-finite loss).
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _record(run_dir, what: str):
    """Note the fault in RUN_DIR/faults.log before it is injected (flushed to disk: a SIGKILL follows), so a drill
    can tell that its fault happened without reading which failure the launcher reported first."""
    with open(Path(run_dir) / "faults.log", "a") as f:
        f.write(what + "\n")
        f.flush()
        os.fsync(f.fileno())


def _install(spec: str):
    from megatron_k3.training import loop
    from megatron_k3.training.checkpoint import shards

    kind, *rest = spec.split(":")
    step = int(rest[0])
    arg = int(rest[1]) if len(rest) > 1 else None
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return  # the restarted attempt runs clean
    if kind in ("kill", "sigterm"):
        sig = signal.SIGKILL if kind == "kill" else signal.SIGTERM
        orig = loop.Trainer.train_step

        def train_step(self):
            out = orig(self)
            if self.step == step and self.rank == (arg or 0):
                _record(self.run_dir, f"{kind} rank {self.rank} after step {step}")
                os.kill(os.getpid(), sig)
            return out

        loop.Trainer.train_step = train_step
    elif kind == "nan":
        orig_forward = loop.Trainer._forward

        def forward(self, samples):
            out, n = orig_forward(self, samples)
            if self.step + 1 == step and self.rank == (arg or 0) and self.model.training:
                out.loss = out.loss * float("nan")
            return out, n

        loop.Trainer._forward = forward
    elif kind == "kill_in_save":
        orig_write, files = shards.fsync, []

        def fsync_then_maybe_die(path):
            orig_write(path)
            if Path(path).parent.name == f".tmp-step_{step:08d}":
                files.append(path)
                if len(files) >= (arg or 1):
                    os.kill(os.getpid(), signal.SIGKILL)

        shards.fsync = fsync_then_maybe_die
    else:
        raise SystemExit(f"K3_FAULT={spec!r}: unknown fault {kind!r}")


if __name__ == "__main__":
    if os.environ.get("K3_FAULT"):
        _install(os.environ["K3_FAULT"])
    from megatron_k3.train import main

    sys.exit(main())
