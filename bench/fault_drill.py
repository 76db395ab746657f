"""Fault drill: inject faults at random points into real training runs and check that each is survived with
nothing lost (the heavier companion of tests/test_fault_drills.py; same injector, tests/fault_entry.py).

    .venv/bin/python bench/fault_drill.py [--kills 3] [--terms 2] [--save-kills 3] [--nans 2] [--seed 0]

- kill: SIGKILL to a random rank after a random step under `torchrun --nproc_per_node 2 --max-restarts 1`;
  survived = exit 0 and every step's loss equal to the uninterrupted 2-rank run (bit for bit).
- term: SIGTERM to a random rank after a random step; survived = exit 0 with a checkpoint at that step, and the
  resumed run's losses equal the uninterrupted run's.
- save-kill: SIGKILL (one process) after a random number of the files of a random checkpoint; survived = the
  previous checkpoint intact, the next start resumes and ends with the uninterrupted losses.
- nan: one step's loss made NaN on a random rank; survived = the run finishes, that step counted as skipped, the
  steps before it equal the uninterrupted run's and the steps after it finite.
Prints one line per fault and the totals; exit 1 if any fault was not survived.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers import DRILL, logged_losses, run_drill  # noqa: E402

STEPS = 8
ARGS = [a for a in DRILL if not a.startswith(("train.steps=", "train.save_interval="))] + [
    f"train.steps={STEPS}", "train.save_interval=2"]


def rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--terms", type=int, default=2)
    ap.add_argument("--save-kills", type=int, default=3)
    ap.add_argument("--nans", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    tmp = Path(tempfile.mkdtemp(prefix="k3-fault-drill-"))
    ref2, ref1 = tmp / "ref_dp2", tmp / "ref_one"
    assert run_drill(ARGS, ref2, nproc=2).returncode == 0 and run_drill(ARGS, ref1).returncode == 0
    want2, want1 = logged_losses(ref2), logged_losses(ref1)
    results = []

    def record(kind, detail, ok, why=""):
        results.append(ok)
        print(f"{kind:10s} {detail:28s} {'survived' if ok else 'LOST'} {why}", flush=True)

    for i in range(a.kills):
        step, rank = rng.randint(1, STEPS - 1), rng.randint(0, 1)
        d = tmp / f"kill{i}"
        p = run_drill(ARGS, d, fault=f"kill:{step}:{rank}", nproc=2, restarts=1)
        got = logged_losses(d) if (d / "metrics.jsonl").is_file() else {}
        record("kill", f"rank {rank} after step {step}", p.returncode == 0 and "exitcode: -9" in p.stderr
               and got == want2, f"(max |loss diff| {max((abs(got.get(s, math.inf) - v) for s, v in want2.items()))})")
    for i in range(a.terms):
        step, rank = rng.randint(1, STEPS - 1), rng.randint(0, 1)
        d = tmp / f"term{i}"
        p1 = run_drill(ARGS, d, fault=f"sigterm:{step}:{rank}", nproc=2)
        saved = (d / "checkpoints" / f"step_{step:08d}" / "meta.json").is_file()
        p2 = run_drill(ARGS, d, nproc=2)
        record("term", f"rank {rank} after step {step}", p1.returncode == 0 and saved and p2.returncode == 0
               and logged_losses(d) == want2)
    for i in range(a.save_kills):
        step, files = rng.choice(range(2, STEPS, 2)), rng.randint(1, 3)
        d = tmp / f"save{i}"
        p1 = run_drill(ARGS, d, fault=f"kill_in_save:{step}:{files}")
        p2 = run_drill(ARGS, d)
        record("save-kill", f"checkpoint {step} after {files} files", p1.returncode == -9 and p2.returncode == 0
               and "ignoring incomplete checkpoint" in p2.stdout and logged_losses(d) == want1)
    for i in range(a.nans):
        step, rank = rng.randint(2, STEPS - 1), rng.randint(0, 1)
        d = tmp / f"nan{i}"
        p = run_drill(ARGS, d, fault=f"nan:{step}:{rank}", nproc=2)
        r = rows(d) if (d / "metrics.jsonl").is_file() else []
        ok = (p.returncode == 0 and len(r) == STEPS and [x["skipped"] for x in r].count(1) == 1
              and r[step - 1]["skipped"] == 1 and all(r[s - 1]["loss"] == want2[s] for s in range(1, step))
              and all(math.isfinite(x["loss"]) for x in r[step:]))
        record("nan", f"rank {rank} at step {step}", ok)
    print(f"faults injected: {len(results)}, survived: {sum(results)}, lost: {len(results) - sum(results)}")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
