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
from helpers import STATIC, N, full_params, gather_states, make_trainer, resume_with, same, straight_and_resumed

pytestmark = pytest.mark.slow  # multi-process worlds or training runs


@pytest.mark.parametrize("world,overrides", [
    (1, []),
    (2, ["parallel.tp=2"]),
    (2, ["parallel.ep=2"] + STATIC),
    (2, ["parallel.ep=2", "model.moe_overflow=balanced", "moe.replica_exchange=step"]),
    (2, ["parallel.zero_stage=1"]),
], ids=["one-process", "tp2", "ep2", "ep2-balanced", "dp2-zero1"])
def test_resume_is_bitwise_under_every_layout(tmp_path, world, overrides):
    for rank, (straight, resumed, p_straight, p_resumed, bias, r_bias) in enumerate(
            run_distributed(straight_and_resumed, world, overrides, str(tmp_path), timeout=300)):
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


@pytest.mark.parametrize("save_world,save_layout,load_world,load_layout", [
    (4, ["parallel.tp=2", "parallel.ep=2"], 1, []),
    (1, [], 4, ["parallel.tp=2", "parallel.ep=2"]),
], ids=["tp2xep2-to-tp1", "tp1-to-tp2xep2"])
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
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_checkpoint", os.path.join(
        os.path.dirname(__file__), "..", "tools", "convert_checkpoint.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


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
