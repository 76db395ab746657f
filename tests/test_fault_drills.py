"""Fault drills with real signals to real training processes (tests/fault_entry.py injects them):

- a worker SIGKILLed mid-run under `torchrun --max-restarts 1`: the restart resumes from the newest complete
  checkpoint and every step's loss equals the uninterrupted run's, bit for bit;
- SIGTERM to one rank of two: both save a checkpoint at the same step and exit 0; the resumed run finishes with
  the uninterrupted losses;
- SIGKILL in the middle of writing a checkpoint: the newest complete checkpoint is untouched, the next start
  reports the incomplete one and resumes from the previous, and the losses equal the uninterrupted run's.
"""

import pytest
from helpers import DRILL, logged_losses, run_drill

pytestmark = pytest.mark.slow  # multi-process worlds or training runs


@pytest.fixture(scope="module")
def straight_dp2(tmp_path_factory):
    """The uninterrupted 2-rank run both torchrun drills compare with."""
    d = tmp_path_factory.mktemp("straight_dp2")
    p = run_drill(DRILL, d, nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    return logged_losses(d)


def test_sigkill_under_torchrun_restarts_and_resumes_exactly(tmp_path, straight_dp2):
    p = run_drill(DRILL, tmp_path / "killed", fault="kill:3:1", nproc=2, restarts=1)
    assert p.returncode == 0, p.stderr[-3000:]
    # the injected SIGKILL did happen (torchrun's summary may name the survivor's exit first, so the fault's own
    # record is read), and the attempt after it resumed from the newest complete checkpoint
    assert (tmp_path / "killed" / "faults.log").read_text() == "kill rank 1 after step 3\n"
    assert "resumed from" in p.stdout and "step_00000002" in p.stdout, p.stdout[-3000:]
    a, b = straight_dp2, logged_losses(tmp_path / "killed")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert a == b, (a, b)


def test_sigterm_saves_and_exits_cleanly_on_every_rank(tmp_path, straight_dp2):
    d = tmp_path / "preempted"
    p = run_drill(DRILL, d, fault="sigterm:3:1", nproc=2)  # only rank 1 gets the signal
    assert p.returncode == 0, p.stderr[-3000:]
    assert "preempted (" in p.stdout and "at step 3" in p.stdout, p.stdout[-3000:]
    assert (d / "checkpoints" / "step_00000003" / "meta.json").is_file()
    assert max(logged_losses(d)) == 3
    p = run_drill(DRILL, d, nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    assert logged_losses(d) == straight_dp2


@pytest.fixture(scope="module")
def straight_one(tmp_path_factory):
    d = tmp_path_factory.mktemp("straight_one")
    p = run_drill(DRILL, d)
    assert p.returncode == 0, p.stderr[-3000:]
    return logged_losses(d)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path, straight_one, mode):
    """Async: the kill comes from the writer thread while the step loop has gone on."""
    args = DRILL + (["checkpoint.async_save=true"] if mode == "async" else [])
    d = tmp_path / "killed"
    p = run_drill(args, d, fault="kill_in_save:4:2")  # dies after 2 of the files of checkpoint 4
    assert p.returncode == -9, (p.returncode, p.stderr[-3000:])
    ckpts = d / "checkpoints"
    assert (ckpts / ".tmp-step_00000004").is_dir() and not (ckpts / "step_00000004").exists()
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    p = run_drill(args, d)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "ignoring incomplete checkpoint" in p.stdout and ".tmp-step_00000004" in p.stdout, p.stdout[-3000:]
    assert "resumed from" in p.stdout and "step_00000002" in p.stdout
    assert logged_losses(d) == straight_one
