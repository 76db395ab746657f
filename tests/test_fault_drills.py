"""Fault drills with real signals to real training processes (tests/fault_entry.py injects them):

- a worker SIGKILLed mid-run under `torchrun --max-restarts 1`: the restart resumes from the newest complete
  checkpoint and every step's loss equals the uninterrupted run's, bit for bit;
- SIGTERM to one rank of two: both save a checkpoint at the same step and exit 0; the resumed run finishes with
  the uninterrupted losses;
- SIGKILL in the middle of writing a checkpoint: the newest complete checkpoint is untouched, the next start
  reports the incomplete one and resumes from the previous, and the losses equal the uninterrupted run's.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # multi-process worlds or training runs

ROOT = Path(__file__).resolve().parent.parent
ENTRY = str(Path(__file__).with_name("fault_entry.py"))
FAST = ["model.num_layers=4", "model.hidden_size=64", "model.dense_intermediate_size=128",
        "model.attn_res_block_size=2", "train.seq_length=64", "train.micro_batch_size=2",
        "train.global_batch_size=4", "train.eval_interval=0", "optim.warmup_steps=2",
        "logging.wandb.mode=disabled", "train.steps=6", "train.save_interval=2", "checkpoint.load=auto"]


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args, run_dir, fault=None, nproc=1, restarts=0, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("K3_FAULT", None)
    if fault:
        env["K3_FAULT"] = fault
    if nproc == 1 and not restarts:
        cmd = [sys.executable, ENTRY]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--max-restarts",
               str(restarts), "--master_port", str(_port()), ENTRY]
    return subprocess.run(cmd + args + [f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def losses(run_dir) -> dict:
    """step -> loss; a step logged twice (before a crash and again after the restart) keeps the later value."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = r["loss"]
    return out


@pytest.fixture(scope="module")
def straight_dp2(tmp_path_factory):
    """The uninterrupted 2-rank run both torchrun drills compare with."""
    d = tmp_path_factory.mktemp("straight_dp2")
    p = _run(FAST, d, nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    return losses(d)


def test_sigkill_under_torchrun_restarts_and_resumes_exactly(tmp_path, straight_dp2):
    p = _run(FAST, tmp_path / "killed", fault="kill:3:1", nproc=2, restarts=1)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "exitcode: -9" in p.stderr, p.stderr[-3000:]  # the injected SIGKILL did happen
    assert "resumed from" in p.stdout and "step_00000002" in p.stdout, p.stdout[-3000:]
    a, b = straight_dp2, losses(tmp_path / "killed")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert a == b, (a, b)


def test_sigterm_saves_and_exits_cleanly_on_every_rank(tmp_path, straight_dp2):
    d = tmp_path / "preempted"
    p = _run(FAST, d, fault="sigterm:3:1", nproc=2)  # only rank 1 gets the signal
    assert p.returncode == 0, p.stderr[-3000:]
    assert "preempted (" in p.stdout and "at step 3" in p.stdout, p.stdout[-3000:]
    assert (d / "checkpoints" / "step_00000003" / "meta.json").is_file()
    assert max(losses(d)) == 3
    p = _run(FAST, d, nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    assert losses(d) == straight_dp2


@pytest.fixture(scope="module")
def straight_one(tmp_path_factory):
    d = tmp_path_factory.mktemp("straight_one")
    p = _run(FAST, d)
    assert p.returncode == 0, p.stderr[-3000:]
    return losses(d)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path, straight_one, mode):
    """Async: the kill comes from the writer thread while the step loop has gone on."""
    args = FAST + (["checkpoint.async_save=true"] if mode == "async" else [])
    d = tmp_path / "killed"
    p = _run(args, d, fault="kill_in_save:4:2")  # dies after 2 of the files of checkpoint 4
    assert p.returncode == -9, (p.returncode, p.stderr[-3000:])
    ckpts = d / "checkpoints"
    assert (ckpts / ".tmp-step_00000004").is_dir() and not (ckpts / "step_00000004").exists()
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    p = _run(args, d)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "ignoring incomplete checkpoint" in p.stdout and ".tmp-step_00000004" in p.stdout, p.stdout[-3000:]
    assert "resumed from" in p.stdout and "step_00000002" in p.stdout
    assert losses(d) == straight_one
