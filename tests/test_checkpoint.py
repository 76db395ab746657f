"""Checkpoints: bitwise resume under every layout, resharding across tensor/expert parallel sizes, the
conversion tool, incomplete checkpoints, unsafe pickles and mismatched configs.

Resume: train N+M steps straight, and train N, save, build a fresh Trainer, load, train M: the losses and every
parameter are bit for bit equal (CPU fp32), for one process, tp=2, ep=2 and dp=2 with ZeRO-1. What makes this hold:
fp32 master weights and every optimizer state are stored exactly, the data position and the step (the LR schedule
derives from it) are restored, the Quantile Balancing bias is a checkpointed buffer, every rank's RNG is restored.

Resharding: saved at tp=2 x ep=2 and loaded at tp=1 x ep=1 (and the reverse), every parameter and optimizer
state arrives bit for bit; the logits of the two layouts agree to 1e-5 relative. They cannot be bit-identical:
tensor parallelism sums the row-parallel matmuls in a different order (measured: 5.2e-7 relative in norm).
"""

import json
import logging
import math
import os
import pickle

import pytest
import torch
from dist_utils import run_distributed
from helpers import (
    STATIC,
    N,
    full_params,
    gather_states,
    load_file,
    make_trainer,
    resume_with,
    same,
    straight_and_resumed,
)

pytestmark = pytest.mark.slow  # multi-process worlds or training runs


@pytest.mark.parametrize("world,overrides", [
    (1, []),
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    (2, ["parallel.ep=2"] + STATIC),
    (2, ["parallel.ep=2", "model.moe_overflow=balanced", "moe.replica_exchange=step"]),
    (2, ["parallel.zero_stage=1"]),
], ids=["one-process", "tp2-sp", "ep2", "ep2-balanced", "dp2-zero1"])
def test_resume_is_bitwise_under_every_layout(tmp_path, world, overrides):
    """N + M steps straight against N, a save, a resume and M more: losses, parameters and the routers' biases bit
    for bit; under tp2 + SP the checkpoint is one file per rank (each its own shards)."""
    from megatron_k3.training import checkpoint as ckpt

    results = run_distributed(straight_and_resumed, world, overrides, str(tmp_path), timeout=300)
    if "parallel.tp=2" in overrides:
        assert sorted(p.name for p in ckpt.list_checkpoints(tmp_path)[-1].glob("*.safetensors")) == [
            "rank_00000.safetensors", "rank_00001.safetensors"]
    for rank, (straight, resumed, p_straight, p_resumed, bias, r_bias) in enumerate(results):
        assert straight == resumed, (rank, straight, resumed)
        bad = [n for n in p_straight if not torch.equal(p_straight[n], p_resumed[n])]
        assert not bad, (rank, bad[:5])
        assert all(torch.equal(a, b) for a, b in zip(bias, r_bias))
        assert any(b.abs().max() > 0 for b in bias)  # Quantile Balancing moved it: the check has teeth


IDS = torch.arange(2 * 32).remainder(97).view(2, 32) * 7 % 200


def _logits(trainer):
    trainer.model.eval()
    with torch.no_grad():
        return trainer.model(IDS, return_logits=True).logits.detach().clone()


def _save_then_report(rank, world, overrides, ckpt_dir):
    from megatron_k3.training.checkpoint.deepspeed_state import full_states
    from megatron_k3.training.engine import shutdown

    try:
        t = make_trainer(world, overrides + [f"checkpoint.dir={ckpt_dir}"])
        for _ in range(N):
            t.train_step()
        t.save()
        _, states, _ = full_states(t.engine, list(t.model.named_parameters()), t.ps, t.experts)
        return _logits(t), full_params(t), gather_states(t, states)
    finally:
        shutdown()


def _load_then_report(rank, world, overrides, ckpt_dir):
    from megatron_k3.training.checkpoint.deepspeed_state import full_states
    from megatron_k3.training.engine import shutdown

    try:
        t = make_trainer(world, overrides + [f"checkpoint.load={ckpt_dir}"])
        t.maybe_resume()
        assert t.step == N
        _, states, _ = full_states(t.engine, list(t.model.named_parameters()), t.ps, t.experts)
        return _logits(t), full_params(t), gather_states(t, states)
    finally:
        shutdown()


SIX = ["model.num_experts=6", "model.top_k=2"]  # 3 experts per EP rank at ep=2: blocks of 2 and 1 over edp 2


@pytest.mark.parametrize("save_world,save_layout,load_world,load_layout", [
    (4, ["parallel.tp=2", "parallel.ep=2"], 1, []),
    (1, [], 4, ["parallel.tp=2", "parallel.ep=2"]),
    (4, ["parallel.ep=2"] + SIX, 2, ["parallel.ep=2"] + SIX),  # the experts' states in blocks of 2 + 1, then whole
], ids=["tp2xep2-to-tp1", "tp1-to-tp2xep2", "ep2xedp2-blocks-to-ep2"])
def test_checkpoint_loads_under_another_layout(tmp_path, save_world, save_layout, load_world, load_layout):
    saved = run_distributed(_save_then_report, save_world, STATIC + save_layout, str(tmp_path), timeout=300)[0]
    loaded = run_distributed(_load_then_report, load_world, STATIC + load_layout, str(tmp_path), timeout=300)
    for logits, params, states in loaded:
        same(saved[1], params, "parameters")
        same(saved[2], states, "optimizer states")
        err = ((logits - saved[0]).norm() / saved[0].norm()).item()
        assert err <= 1e-5, err


def _checkpoint_one_process(ckpt_dir, overrides=(), world=1):
    from megatron_k3.training.engine import shutdown

    try:
        t = make_trainer(world, list(overrides) + [f"checkpoint.dir={ckpt_dir}"])
        t.train_step()
        t.save()
        return t.step
    finally:
        shutdown()


def _tp2_checkpoint(rank, world, ckpt_dir):
    return _checkpoint_one_process(ckpt_dir, ["parallel.tp=2"], world)


def _convert_tool():
    return load_file(os.path.join(os.path.dirname(__file__), "..", "tools", "convert_checkpoint.py"))


def _write_format2(src, dst):
    """The tp=2 checkpoint `src` rewritten in format 2 (full size per tensor-parallel shard: model_tpXX,
    optim_tpXX, state_tpXX files), as megatron-k3 wrote it before the sharded format."""
    from safetensors.torch import save_file

    from megatron_k3.training import checkpoint as ckpt

    model, optim, meta = ckpt.read_full(src)
    dims = {n: 0 for n, v in model.items() if v.dim() == 2 and v.shape[0] % 2 == 0}
    dst.mkdir(parents=True)
    for r in range(2):
        def cut(n, v, r=r):
            return v.chunk(2, dims[n])[r].contiguous() if n in dims else v.contiguous()
        save_file({n: cut(n, v) for n, v in model.items()}, str(dst / f"model_tp{r:02d}.safetensors"))
        save_file({f"{n}::{k}": cut(n, v) for n, st in optim.items() for k, v in st.items()},
                  str(dst / f"optim_tp{r:02d}.safetensors"))
        torch.save({"optimizer_scalars": meta["optimizer_scalars"]}, dst / f"state_tp{r:02d}.pt")
    legacy = {k: v for k, v in meta.items() if k != "optimizer_scalars"}
    legacy.update(format_version=2, tensor_parallel=2, pipeline_parallel=1, tp_split_dims=dims)
    (dst / "meta.json").write_text(json.dumps(legacy))
    return model, optim


def test_format2_checkpoints_are_refused_with_the_conversion_and_convert_bit_for_bit(tmp_path):
    """A checkpoint in the old format (full size per tensor-parallel shard) is refused by the Trainer with one line
    saying how to convert it; tools/convert_checkpoint.py converts it, and the result holds every tensor bit for
    bit and loads."""
    from megatron_k3.training import checkpoint as ckpt

    tool = _convert_tool()
    run_distributed(_tp2_checkpoint, 2, str(tmp_path / "tp2"), timeout=300)
    old = tmp_path / "old" / "step_00000001"
    model, optim = _write_format2(ckpt.list_checkpoints(tmp_path / "tp2")[-1], old)
    err = run_distributed(_resume_from, 1, str(old), timeout=300)[0]
    assert err is not None and "format 2" in err and "tools/convert_checkpoint.py" in err and "\n" not in err, err
    new = tool.convert(old, tmp_path / "new")
    m2, o2, meta = ckpt.read_full(new)
    same(model, m2, "weights")
    same({f"{n}::{k}": v for n, st in optim.items() for k, v in st.items()},
         {f"{n}::{k}": v for n, st in o2.items() for k, v in st.items()}, "optimizer states")
    assert meta["format_version"] == ckpt.FORMAT_VERSION and meta["step"] == 1
    assert run_distributed(_resume_from, 1, str(new), timeout=300)[0] is None
    assert tool.main([str(new), str(tmp_path / "again")]) == 2  # already current: nothing to convert


@pytest.fixture(scope="module")
def one_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("one")
    run_distributed(_one_checkpoint, 1, str(d), timeout=300)
    return d


def _one_checkpoint(rank, world, d):
    return _checkpoint_one_process(d)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("victim", ["rng.pt"])
def test_a_crafted_pickle_is_refused(one_checkpoint, tmp_path, victim):
    """A checkpoint file whose pickle would call os.system on load: refused by the reader and by the resume path
    (a one-line config error naming the file), and the command never runs."""
    import shutil

    from megatron_k3.training import checkpoint as ckpt

    src = ckpt.list_checkpoints(one_checkpoint)[-1]
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    marker = tmp_path / "pwned"
    with open(dst / victim, "wb") as f:
        pickle.dump({"ranks": [_Evil(str(marker))], "rng": _Evil(str(marker)), "optimizer_scalars": {}}, f, protocol=2)
    with pytest.raises(ckpt.CheckpointError, match="refused to unpickle"):
        ckpt.load_pickle_safely(dst / victim)
    err = run_distributed(_resume_from, 1, str(dst), timeout=300)[0]
    assert err is not None and "refused to unpickle" in err and victim in err, err
    assert not marker.exists()


def _resume_from(rank, world, path):
    return resume_with(rank, world, path, [])


def test_truncated_file_names_the_file(one_checkpoint, tmp_path):
    import shutil

    from megatron_k3.training import checkpoint as ckpt

    src = ckpt.list_checkpoints(one_checkpoint)[-1]
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    f = dst / "rank_00000.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    err = run_distributed(_resume_from, 1, str(dst), timeout=300)[0]
    assert err is not None and "rank_00000.safetensors" in str(err) and "truncated or corrupted" in str(err), err


def test_mismatched_model_config_names_the_keys(one_checkpoint):
    from megatron_k3.training import checkpoint as ckpt

    path = str(ckpt.list_checkpoints(one_checkpoint)[-1])
    msg = run_distributed(resume_with, 1, path, ["model.num_experts=32", "model.top_k=2"], timeout=300)[0]
    assert msg is not None and "model.num_experts: checkpoint 16, this run 32" in msg, msg
    assert "model.top_k: checkpoint 4, this run 2" in msg and "model.hidden_size" not in msg
    # a runtime-only key (capacity, dispatch mode) may change between save and resume
    assert run_distributed(resume_with, 1, path, ["model.moe_overflow=drop"], timeout=300)[0] is None


def test_incomplete_checkpoints_are_ignored_with_a_warning(one_checkpoint, tmp_path, caplog):
    import shutil

    from megatron_k3.training import checkpoint as ckpt

    d = tmp_path / "ckpts"
    shutil.copytree(one_checkpoint, d)
    good = ckpt.list_checkpoints(d)[-1]
    (d / ".tmp-step_00000009").mkdir()  # killed before the rename
    half = d / "step_00000010"  # a directory that never got its meta.json
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"\0" * 10)
    (d / "step_00000011").mkdir()
    (d / "step_00000011" / "meta.json").write_text(json.dumps({"step": 11}))  # not marked complete
    with caplog.at_level(logging.WARNING, logger="megatron_k3.checkpoint"):
        assert ckpt.resolve_load_path("auto", d) == good
    warned = " ".join(r.getMessage() for r in caplog.records)
    for name in (".tmp-step_00000009", "step_00000010", "step_00000011"):
        assert name in warned, warned


def _resume_steps(rank, world, path):
    from megatron_k3.training.engine import shutdown

    try:
        t = make_trainer(world, [f"checkpoint.load={path}"])
        t.maybe_resume()
        start = dict((n, p.detach().clone()) for n, p in t.model.named_parameters())
        loss = t.train_step()[0]["loss"]
        return t.step, start, loss
    finally:
        shutdown()


def test_convert_tool_to_and_from_hugging_face(one_checkpoint, tmp_path):
    """A training checkpoint -> a K3-layout Hugging Face directory (fp32 non-expert tensors, MXFP4 experts) -> a
    step-0 training checkpoint that a run starts from: non-expert weights arrive bit for bit, routed experts as
    their MXFP4 values."""
    from megatron_k3.interop.k3_experts import dequantize_k3_weight, quantize_k3_weight
    from megatron_k3.training import checkpoint as ckpt

    tool = _convert_tool()
    src = ckpt.list_checkpoints(one_checkpoint)[-1]
    assert tool.main([str(src), str(tmp_path / "hf"), "--to-hf", "--dtype", "float32"]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
    assert tool.main([str(tmp_path / "hf"), str(tmp_path / "back"), "--from-hf"]) == 0
    saved, _, _ = ckpt.read_full(src)
    back = ckpt.list_checkpoints(tmp_path / "back")[-1]
    step, start, loss = run_distributed(_resume_steps, 1, str(back), timeout=300)[0]
    assert step == 1 and math.isfinite(loss)
    for n, p in start.items():
        if ".mlp.experts." in n:  # [E, out, in]: each expert's matrix through MXFP4
            want = torch.stack([dequantize_k3_weight(*quantize_k3_weight(w)) for w in saved[n]])
        else:
            want = saved[n]
        assert torch.equal(p, want), n


def _restarts(rank, world, d):
    """The same command twice in one checkpoint.dir (4 steps, then 6), then a fresh start there
    (checkpoint.load=none): (the second run's first step, the error the fresh run's first save raised, the warning it
    logged at the start, the newest checkpoint's file corrupted: what resuming it raises)."""
    from megatron_k3.training import checkpoint as ckpt
    from megatron_k3.training.engine import shutdown

    os.makedirs(f"{d}_run", exist_ok=True)

    def run(steps, more=()):
        try:
            t = make_trainer(world, [f"checkpoint.dir={d}", "train.save_interval=2", *more], steps=steps,
                             run_dir=f"{d}_run")
            first = []
            step = t.train_step
            t.train_step = lambda: (first.append(t.pos.step), step())[1]
            t.fit({})
            return first[0]
        finally:
            shutdown()

    run(4)
    resumed_at = run(6)
    warned = []
    handler = logging.Handler()
    handler.emit = lambda r: warned.append(r.getMessage())
    logging.getLogger("megatron_k3.train").addHandler(handler)
    try:
        run(2, ["checkpoint.load=none"])
        fresh_err = None
    except ckpt.CheckpointError as e:
        fresh_err = str(e)
    f = ckpt.list_checkpoints(d)[-1] / "rank_00000.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return resumed_at, fresh_err, warned, resume_with(rank, world, "auto", [f"checkpoint.dir={d}"])


def test_a_restart_never_destroys_a_run(tmp_path):
    """checkpoint.load=auto by default: the same command run again in a directory holding its checkpoints resumes
    (4 steps saving every 2, then the command with train.steps=6 starts at step 4), and no checkpoint is rewritten.
    Starting fresh there needs checkpoint.load=none, which warns and never replaces another run's checkpoint (its
    first save stops the run, naming it). A corrupted newest checkpoint names the file and the newest intact one."""
    from megatron_k3.training import checkpoint as ckpt

    d = tmp_path / "ckpt"
    resumed_at, fresh_err, warned, corrupted = run_distributed(_restarts, 1, str(d), timeout=300)[0]
    assert resumed_at == 4
    assert [p.name for p in ckpt.list_checkpoints(d)] == ["step_00000002", "step_00000004", "step_00000006"]
    assert len({ckpt.run_of(p) for p in ckpt.list_checkpoints(d)}) == 1  # the resumed run kept the first's id
    assert fresh_err is not None and "step_00000002 was written by another run" in fresh_err, fresh_err
    assert any("checkpoint.load=none: starting fresh" in w and "step_00000006" in w for w in warned), warned
    assert json.loads((d / "step_00000002" / "meta.json").read_text())["step"] == 2  # kept, not replaced
    assert corrupted is not None and "step_00000006/rank_00000.safetensors" in corrupted, corrupted
    assert f"the newest intact checkpoint is {d / 'step_00000004'}" in corrupted, corrupted


def test_keep_last_prunes_only_the_runs_own_checkpoints(tmp_path):
    """commit(keep_last=1) removes this run's older checkpoints, never another run's (nor one without a run id)."""
    from megatron_k3.training import checkpoint as ckpt

    for step, run_id in ((1, "other"), (2, None), (3, "mine"), (4, "other")):
        p = tmp_path / f"step_{step:08d}"
        p.mkdir()
        (p / "meta.json").write_text(json.dumps({"step": step, "complete": True, "run_id": run_id}))
    tmp, final = ckpt.begin(tmp_path, 5)
    ckpt.commit(tmp, final, {"step": 5, "run_id": "mine"}, keep_last=1)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [f"step_{s:08d}" for s in (1, 2, 4, 5)]


def test_convert_tool_writes_a_vision_language_checkpoint_with_its_tower(tmp_path):
    """--to-hf of a vision-language training checkpoint (model.vision.enabled): the tower and projector go into the
    K3 directory beside the text model, which load_hf reads back as K3ForConditionalGeneration, every tensor bit
    for bit in float32 but the routed experts (their MXFP4 values)."""
    import dataclasses

    from megatron_k3.config import load_model_config
    from megatron_k3.interop import load_hf
    from megatron_k3.interop.k3_experts import dequantize_k3_weight, quantize_k3_weight
    from megatron_k3.model import K3ForConditionalGeneration
    from megatron_k3.training import checkpoint as ckpt

    cfg = load_model_config("k3_vl_tiny", ["num_layers=2"])
    torch.manual_seed(0)
    model = K3ForConditionalGeneration(cfg)
    tensors = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    src = ckpt.save_checkpoint(tmp_path / "ckpt", 3, tensors, {}, {}, {"step": 3, "model": dataclasses.asdict(cfg)})
    assert _convert_tool().main([str(src), str(tmp_path / "hf"), "--to-hf", "--dtype", "float32"]) == 0
    back = load_hf(tmp_path / "hf")
    assert isinstance(back, K3ForConditionalGeneration)
    got = dict(back.named_parameters())
    assert any(n.startswith("vision_tower.") for n in got) and sorted(got) == sorted(dict(model.named_parameters()))
    for n, p in model.named_parameters():
        want = torch.stack([dequantize_k3_weight(*quantize_k3_weight(w)) for w in p.detach()]) \
            if ".mlp.experts." in n else p.detach()
        assert torch.equal(got[n].float(), want), n
