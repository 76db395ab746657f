"""Checkpoint discovery ignores incomplete saves; the LR schedule's shape."""

import json
import math

import torch

from megatron_k3.optim.schedule import lr_at
from megatron_k3.training.checkpoint import list_checkpoints, read_full, read_meta, resolve_load_path, save_checkpoint


def _tensors(model, opt):
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    states = {n: {k: v for k, v in opt.state[p].items() if v.dim() > 0} for n, p in model.named_parameters()}
    return weights, states


def test_incomplete_or_corrupt_checkpoints_are_never_picked(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    weights, states = _tensors(model, opt)
    save_checkpoint(tmp_path, 5, weights, states, {"dense.0": {"step": 1}}, {"consumed_samples": 40, "tokens": 0})
    (tmp_path / ".tmp-step_00000009-123").mkdir()  # a save that died before its rename
    (tmp_path / "step_00000010").mkdir()  # no meta.json
    (tmp_path / "step_00000011").mkdir()
    (tmp_path / "step_00000011" / "meta.json").write_text("{not json")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000005"]
    assert resolve_load_path("auto", tmp_path).name == "step_00000005"
    assert (tmp_path / "latest").read_text().strip() == "step_00000005"
    meta = read_meta(tmp_path / "step_00000005")
    w, st, meta = read_full(tmp_path / "step_00000005")
    assert meta["consumed_samples"] == 40 and meta["optimizer_scalars"] == {"dense.0": {"step": 1}}
    assert torch.equal(w["weight"], model.weight)
    assert torch.equal(st["weight"]["exp_avg"], opt.state[model.weight]["exp_avg"])


def test_keep_last_prunes_old_checkpoints(tmp_path):
    model = torch.nn.Linear(2, 2)
    for s in range(1, 6):
        save_checkpoint(tmp_path, s, dict(model.state_dict()), {}, {}, {"consumed_samples": s, "tokens": 0},
                        keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]
    assert json.loads((tmp_path / "step_00000005" / "meta.json").read_text())["complete"] is True


def test_lr_schedule_warmup_then_cosine():
    lrs = [lr_at(s, 100, 1.0, 0.1, 10) for s in range(1, 101)]
    assert lrs[0] == 0.1 and lrs[9] == 1.0  # linear warmup to the peak at step 10
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # then non-increasing
    assert math.isclose(lrs[-1], 0.1) and math.isclose(lr_at(55, 100, 1.0, 0.1, 10), 0.55)
    assert lr_at(50, 100, 1.0, 0.1, 10, "constant") == 1.0
