"""Fault tolerance, in-process part: non-finite steps are skipped (and counted) and a run of them stops naming
where they start; collectives that time out name their group and ranks; preemption and corrupted inputs give
clear, loss-free outcomes. The process-killing drills (SIGKILL under torchrun --max-restarts, SIGTERM, a kill
during a save) are in tests/test_fault_drills.py; bench/fault_drill.py repeats them at random points."""

import math
import time

import pytest
import torch
from dist_utils import DistributedError, run_distributed
from helpers import FAST, STATIC, full_params, make_trainer


def _trainer(world, overrides, run_dir="/tmp/k3-test-faults-unused"):
    return make_trainer(world, overrides, steps=6, run_dir=run_dir)


def _nan_once(rank, world, overrides, bad_step):
    """Train 4 steps; step `bad_step`'s loss is multiplied by NaN on rank 0 only (one rank's bad batch)."""
    from megatron_k3.training.engine import shutdown

    try:
        t = _trainer(world, overrides)
        forward = t._forward

        def poisoned(samples):
            out, n = forward(samples)
            if t.step + 1 == bad_step and t.rank == 0:
                out.loss = out.loss * float("nan")
            return out, n

        t._forward = poisoned
        recs, params, biases = [], [], []
        for _ in range(4):
            recs.append(t.train_step()[0])
            params.append(full_params(t))
            biases.append([m.gate.e_score_correction_bias.clone() for m in t.moe])
        return recs, params, biases
    finally:
        shutdown()


@pytest.mark.parametrize("world,overrides", [
    (1, []),
    (1, ["parallel.zero_stage=0"]),
    (2, ["parallel.ep=2"] + STATIC),
], ids=["zero1", "zero0", "ep2"])
@pytest.mark.slow
def test_a_non_finite_step_is_skipped_and_counted(world, overrides):
    for recs, params, biases in run_distributed(_nan_once, world, overrides, 3, timeout=300):
        assert [r["skipped"] for r in recs] == [0, 0, 1, 0]
        assert [r["skipped_total"] for r in recs] == [0, 0, 1, 1]
        assert not math.isfinite(recs[2]["loss"]) and all(math.isfinite(recs[i]["loss"]) for i in (0, 1, 3))
        # the skipped step changed nothing: weights (experts included) and the Quantile Balancing bias
        assert all(torch.equal(params[2][n], params[1][n]) for n in params[1])
        assert all(torch.equal(a, b) for a, b in zip(biases[2], biases[1]))
        # and training went on: the next step moved the weights again
        assert any(not torch.equal(params[3][n], params[2][n]) for n in params[2])
        assert recs[3]["loss"] < recs[0]["loss"] + 0.5


def _persistent(rank, world, overrides, how, run_dir):
    from megatron_k3.training.engine import shutdown
    from megatron_k3.training.faults import NonFiniteError

    try:
        t = _trainer(world, overrides + ["train.max_consecutive_skips=2"], run_dir)
        t.save = lambda: None
        target = "model.layers.2.self_attn.q_proj.weight"
        if how == "activation":
            layer = t.model.model.layers[1].mlp  # the MoE block of the second layer

            def hook(module, inputs, output):
                return output * float("nan") if t.step >= 2 else output

            layer.register_forward_hook(hook)
        else:
            orig = t.train_step

            def step_then_corrupt():
                out = orig()
                if t.step == 2:
                    with torch.no_grad():
                        dict(t.model.named_parameters())[target].view(-1)[3] = float("inf")
                return out

            t.train_step = step_then_corrupt
        try:
            t.fit({})
        except NonFiniteError as e:
            return t.step, t.skips.total, str(e)
        return t.step, t.skips.total, None
    finally:
        shutdown()


@pytest.mark.parametrize("how,where", [
    ("parameter", "parameter model.layers.2.self_attn.q_proj.weight holds non-finite values"),
    ("activation", "module model.layers.1.mlp produced the first non-finite forward output"),
])
@pytest.mark.slow
def test_consecutive_non_finite_steps_stop_naming_the_first_bad_place(tmp_path, how, where):
    step, skipped, msg = run_distributed(_persistent, 1, [], how, str(tmp_path), timeout=300)[0]
    assert step == 4 and skipped == 2, (step, skipped, msg)
    assert msg is not None and "steps 3..4" in msg and where in msg, msg


def _stall(rank, world, minutes):
    """tp=2: rank 1 stalls before its first step; rank 0 reaches a tensor-parallel collective and times out."""
    from megatron_k3.training.engine import shutdown
    from megatron_k3.training.faults import CollectiveError

    try:
        t = _trainer(world, ["parallel.tp=2", f"parallel.timeout_minutes={minutes}"])
        if rank == 1:
            time.sleep(8)
            return None
        t0 = time.time()
        try:
            t.train_step()
        except CollectiveError as e:
            return str(e), time.time() - t0
        return None
    finally:
        shutdown()


@pytest.mark.slow
def test_a_collective_timeout_names_the_group_and_its_ranks():
    try:
        results = run_distributed(_stall, 2, 0.05, timeout=120)
    except DistributedError as e:  # rank 1's own later collectives may fail once rank 0 has given up
        pytest.fail(str(e)[-3000:])
    msg, waited = results[0]
    assert "rank 0:" in msg and "tp group (ranks [0, 1]" in msg and "timed out" in msg, msg
    assert waited < 15, waited  # 3 s configured, not the 30 min default


def test_config_keys_are_validated():
    from megatron_k3.config import ConfigError, compose_run_config

    with pytest.raises(ConfigError, match="train.max_consecutive_skips"):
        compose_run_config(FAST + ["train.max_consecutive_skips=0"])
    with pytest.raises(ConfigError, match="parallel.timeout_minutes"):
        compose_run_config(FAST + ["parallel.timeout_minutes=0"])


@pytest.fixture(scope="module")
def indexed_data(tmp_path_factory):
    """A small Megatron-format dataset and its tokenizer (tools/preprocess_data.py on stdlib sources)."""
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    d = tmp_path_factory.mktemp("indexed")
    files = sorted(str(p) for p in (Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py"))
    tool = Path(__file__).resolve().parent.parent / "tools" / "preprocess_data.py"
    subprocess.run([sys.executable, str(tool), "--input", *files, "--output-prefix", str(d / "a"), "--train-bpe",
                    "512"], check=True, capture_output=True, timeout=300)
    return d


def _train_cli(args, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    p = subprocess.run([sys.executable, "-m", "megatron_k3.train", *args, "logging.wandb.mode=disabled",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=Path(__file__).resolve().parent.parent,
                       capture_output=True, text=True, timeout=300)
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    return p.returncode, lines, p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tokenizer garbage", "tokenizer too large", "idx truncated", "bin truncated"])
def test_corrupted_or_mismatched_files_name_the_file_or_key(indexed_data, tmp_path, case):
    """Corrupted or mismatched dataset and tokenizer files: exit code 2 and one line naming the key and the file."""
    import shutil

    d = tmp_path / "data"
    shutil.copytree(indexed_data, d)
    tok, vocab = d / "a.tokenizer.json", "512"
    if case == "tokenizer garbage":
        tok.write_text('{"version": "1.0", "model": ')
        key, name = "data.tokenizer", "a.tokenizer.json"
    elif case == "tokenizer too large":
        vocab, key, name = "256", "model.vocab_size", "256"
    elif case == "idx truncated":
        f = d / "a.idx"
        f.write_bytes(f.read_bytes()[:-8])
        key, name = "data.paths", "a.idx"
    else:
        f = d / "a.bin"
        f.write_bytes(f.read_bytes()[:-4])
        key, name = "data.paths", "a.bin"
    rc, lines, err = _train_cli(["data=indexed", f"data.paths=[{d / 'a'}]", f"data.tokenizer={tok}",
                                 f"model.vocab_size={vocab}", "model.num_layers=4", "model.hidden_size=64",
                                 "model.dense_intermediate_size=128", "model.attn_res_block_size=2",
                                 "train.seq_length=64", "train.steps=1"], tmp_path)
    assert rc == 2 and len(lines) == 1, err[-3000:]
    assert key in lines[0] and name in lines[0], lines[0]
    assert "Traceback" not in err, err[-3000:]
