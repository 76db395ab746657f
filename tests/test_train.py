"""Training from the command line: one-line config errors, exact resume, metrics and the offline W&B run."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import CLI_FAST, launch, logged_losses

from megatron_k3.train import main
from megatron_k3.training.wandb_files import find_run_files, history

pytestmark = pytest.mark.slow  # multi-process worlds or training runs

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("override,key", [
    ("model.top_k=99", "model.top_k"),
    ("train.micro_batch_size=-2", "train.micro_batch_size"),
    ("model.hidden_size=wide", "model.hidden_size"),
    ("parallel.tp=3", "parallel.tp"),
    ("train.global_batch_size=6", "train.global_batch_size"),
    ("model.no_such_key=1", "model.no_such_key"),
    ("optim=sgd", "optim"),
    ("checkpoint.load=/no/such/dir", "checkpoint.load"),
    ("train.tile_tokens=48", "train.tile_tokens"),  # does not divide the 1024 tokens of a micro-batch
])
def test_bad_override_exits_with_one_line(override, key, tmp_path):
    t = time.time()
    run_dir = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "megatron_k3.train", override, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and key in lines[0] and override.split("=")[1] in lines[0], p.stderr
    assert lines[0].count(key) == 1  # the key once (a message naming it again reads as a second error)
    assert time.time() - t < 30  # before any compute
    assert not run_dir.exists()  # nothing written


def test_the_error_line_reaches_stderr_in_one_write(monkeypatch):
    """Under torchrun every worker and torchrun itself share one stderr; print() writes a line's text and its newline
    apart, so with PYTHONUNBUFFERED (CI sets it) torchrun's warning once landed on the error's line."""
    from megatron_k3.errors import ConfigError, report_error

    class Writes:
        def __init__(self):
            self.calls = []

        def write(self, text):
            self.calls.append(text)
            return len(text)

        def flush(self):
            pass

    err = Writes()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert report_error(ConfigError("parallel.tp", 2, "must divide model.kda_num_heads=3"), 2) == 2
    assert err.calls == ["error: invalid config: parallel.tp=2: must divide model.kda_num_heads=3\n"]


@pytest.mark.parametrize("override,near", [
    ("train.step=5", "did you mean train.steps?"),
    ("trian.steps=5", "did you mean train.steps?"),
    ("optim.lrr=1e-3", "did you mean optim.lr?"),
    ("model=k3_tin", "did you mean model=k3_tiny?"),
    # Hydra's + and ++ add a key even to the schema-checked config: refused all the same, not silently ignored
    ("+train.recompute_method=block", "did you mean train.recompute_modules?"),
    ("++model.hidden_sise=32", "did you mean model.hidden_size?"),
    ("+train.foo=1", "train.foo='1': unknown key"),
])
def test_a_misspelled_key_suggests_the_near_one(override, near):
    from megatron_k3.config import ConfigError, compose_run_config

    with pytest.raises(ConfigError, match=re.escape(near)):
        compose_run_config([override])


def test_a_plus_override_of_a_free_form_section_is_kept():
    """parallel.deepspeed is a dict merged over the generated DeepSpeed config: + adds any key there."""
    from megatron_k3.config import compose_run_config

    run, _, _ = compose_run_config(["+parallel.deepspeed.zero_optimization.reduce_bucket_size=4096"])
    assert run.parallel.deepspeed == {"zero_optimization": {"reduce_bucket_size": 4096}}


def test_a_checkpoint_load_that_holds_no_checkpoint_stops_before_building(tmp_path):
    """A directory that exists but holds no checkpoint is refused with the config, naming what was expected; a run
    that fails while building (here: a checkpoint written by another model) leaves no run directory behind."""
    from megatron_k3.config import ConfigError, compose_run_config

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no checkpoint") as e:
        compose_run_config([f"checkpoint.load={empty}"])
    assert e.value.key == "checkpoint.load" and "meta.json" in str(e.value)
    ckpt = tmp_path / "ckpt"
    args = CLI_FAST + ["train.steps=1", "train.eval_interval=0", "logging.wandb.mode=disabled",
                       f"checkpoint.dir={ckpt}"]
    assert main(args + [f"hydra.run.dir={tmp_path / 'first'}"]) == 0
    other = tmp_path / "other"
    assert main(args + ["model.hidden_size=32", f"checkpoint.load={ckpt}", f"hydra.run.dir={other}"]) == 2
    assert not other.exists()


def test_sequence_length_the_data_cannot_serve(tmp_path):
    rc = main(CLI_FAST + ["train.seq_length=100000000", f"hydra.run.dir={tmp_path}", "logging.wandb.mode=disabled"])
    assert rc == 2


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_is_bitwise_identical(tmp_path, precision):
    a, b = tmp_path / "straight", tmp_path / "resumed"
    # optim=muon (the default, explicit here): ZeRO-1's flat Muon momentum round-trips through the checkpoint; under
    # bf16 also the fp32 masters of the bf16 weights
    common = CLI_FAST + ["train.steps=8", "logging.wandb.mode=disabled", "train.save_interval=0", "optim=muon",
                         f"precision={precision}"]
    assert main(common + [f"hydra.run.dir={a}"]) == 0
    assert main(common + [f"hydra.run.dir={b}", "train.exit_interval=4"]) == 0
    assert max(logged_losses(b)) == 4 and (b / "checkpoints" / "step_00000004" / "meta.json").is_file()
    assert main(common + [f"hydra.run.dir={b}", "checkpoint.load=auto"]) == 0
    la, lb = logged_losses(a), logged_losses(b)
    assert sorted(la) == sorted(lb) == list(range(1, 9))
    assert all(la[s] == lb[s] for s in la), [(s, la[s], lb[s]) for s in la if la[s] != lb[s]]


def test_metrics_and_offline_wandb_hold_loss_and_expert_load(tmp_path):
    assert main(CLI_FAST + ["train.steps=6", f"hydra.run.dir={tmp_path}", "logging.wandb.media_interval=3"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    for r in rows:
        for k in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s"):
            assert isinstance(r[k], (int, float))
        assert set(r["expert_load"]) == {"max_over_mean", "cv", "dropped_frac", "dead_experts", "bias_std",
                                         "bias_absmax"}
        assert r["expert_load"]["max_over_mean"] >= 1.0 and r["expert_load"]["dropped_frac"] == 0.0
    assert rows[-1]["tokens"] == 6 * 4 * 64 and "eval_loss" in rows[4]
    assert (tmp_path / ".hydra" / "config.yaml").is_file()
    files = find_run_files(tmp_path)
    assert len(files) == 1
    # the offline run file is written by W&B's service process, which may still be flushing when finish() returns
    deadline = time.time() + 30
    while len(hist := history(files[0])) < 6 and time.time() < deadline:
        time.sleep(0.5)
    assert [h["step"] for h in hist] == list(range(1, 7))
    assert [h["train/loss"] for h in hist] == [r["loss"] for r in rows]
    assert all("expert_load/max_over_mean" in h and "expert_load_layer/001/cv" in h for h in hist)
    assert hist[-1]["expert_load/bias_std"] > 0  # Quantile Balancing moved the selection bias
    assert any("expert_load/heatmap/path" in h for h in hist)  # media every media_interval steps
    n_series = len({k.split("/_")[0] for h in hist for k in h})
    assert n_series < 100  # bounded: global + 2 per MoE layer + top/bottom experts + media


# Two workers on two cores: one intra-op thread each (oversubscribed OpenMP threads spin and make a step 30x slower)
WORKER_ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _torchrun(args, run_dir):
    p = launch(lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_port", str(port), "-m", "megatron_k3.train", *args, f"hydra.run.dir={run_dir}"],
               cwd=ROOT, capture_output=True, text=True, timeout=300, env=WORKER_ENV)
    assert p.returncode == 0, p.stderr[-3000:]


def test_data_parallel_and_resume_across_data_parallel_sizes(tmp_path):
    """torchrun with 2 gloo ranks (each reads half of every global batch; gradients all-reduced) gives the
    single-process losses, and a run stopped under DP=2 resumes under DP=1 (and the reverse) on exactly the
    global sample sequence of the uninterrupted run."""
    args = CLI_FAST + ["train.steps=4", "train.global_batch_size=8", "train.eval_interval=0",
                       "logging.wandb.mode=disabled"]
    straight = tmp_path / "dp1"
    assert main(args + [f"hydra.run.dir={straight}"]) == 0
    a, b = tmp_path / "dp2_then_dp1", tmp_path / "dp1_then_dp2"
    _torchrun(args + ["train.exit_interval=2"], a)
    assert max(logged_losses(a)) == 2
    assert main(args + [f"hydra.run.dir={a}", "checkpoint.load=auto"]) == 0
    assert main(args + [f"hydra.run.dir={b}", "train.exit_interval=2"]) == 0
    _torchrun(args + ["checkpoint.load=auto"], b)
    ref = logged_losses(straight)
    for run in (a, b):
        got = logged_losses(run)
        assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
        for s in ref:  # fp32; gradient sums in a different order across ranks
            assert abs(ref[s] - got[s]) <= 1e-5 * abs(ref[s]), (run.name, s, ref[s], got[s])


def test_deepspeed_launcher_trains_with_bf16_and_zero2(tmp_path):
    """`deepspeed --num_gpus 2 megatron_k3/train.py` (the launcher sets RANK/LOCAL_RANK and passes --local_rank)
    runs the same entry point: two ranks, ZeRO-2, DeepSpeed's bf16 mode."""
    import shutil

    exe = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    assert exe, "the deepspeed launcher is installed with the package"
    args = CLI_FAST + ["train.steps=3", "train.eval_interval=0", "logging.wandb.mode=disabled", "precision=bf16",
                       "parallel.zero_stage=2", f"hydra.run.dir={tmp_path}"]
    p = launch(lambda port: [exe, "--num_gpus", "2", "--master_port", str(port), "megatron_k3/train.py"] + args,
               cwd=ROOT, capture_output=True, text=True, timeout=300, env=WORKER_ENV)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    losses = logged_losses(tmp_path)
    assert sorted(losses) == [1, 2, 3] and all(9.0 < v < 9.2 for v in losses.values()), losses
    step3 = tmp_path / "checkpoints" / "step_00000003"
    assert (step3 / "index.json").is_file() and len(list(step3.glob("rank_*.safetensors"))) == 2


@pytest.mark.parametrize("override,fragment", [
    ("model.kda_num_heads=3", "parallel.tp"),  # tp=2 does not divide the heads
    ("parallel.pp=4", "parallel"),  # tp*pp does not divide the world of 2
])
def test_bad_layout_fails_on_every_rank_under_torchrun(tmp_path, override, fragment):
    p = launch(lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(port), "-m", "megatron_k3.train", "parallel.tp=2", override,
                             f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120,
               env=WORKER_ENV)
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: invalid config") and fragment in line]
    # Each rank validates before its first collective and exits 2; rank 0 prints the line (every rank finds the
    # same; torchrun may stop rank 0 first when another rank exits sooner), and each writes it to torchrun's error
    # file, so torchrun's failure summary ends with it as the root cause, whichever rank it saw fail first
    assert len(errors) <= 1 and "megatron_k3/" not in p.stderr, p.stderr  # no traceback of ours
    last = [line for line in p.stderr.splitlines() if line.strip() and set(line.strip()) != {"="}][-1].strip()
    assert last.startswith("traceback : error: invalid config") and fragment in last, p.stderr[-2000:]
    assert not errors or last == f"traceback : {errors[0]}"
