"""Vision-language training (model=k3_vl_tiny data=multimodal) through the real Trainer: every layout equals one
process, freezing the tower, and resume.

Layouts (gloo workers, fp32, the default optimizer: Per-Head Muon, the tower's q/k/v/o heads included): tp=2 (the
tower replicated, each rank encoding its share of the media, the features gathered, the tower's gradients summed;
the data's micro-batches hold 1-3 media, so a rank sometimes encodes none), tp=2 with sequence parallelism (each
rank inserts its sequence share's features), dp=2 (ZeRO-1) and pp=2 (the tower on the first stage).
Losses of 5 steps within 1e-5 relative and every parameter after them within PARAM_RTOL per tensor, up to a
routing near-tie (tests/trajectory.py).

Measured (5 steps, per tensor, in norm): the tower's and projector's parameters <= 2.3e-6 in every layout; every
text matrix within 1e-5. The worst tensors are text vectors that start at zero and take AdamW steps (ZERO_INIT):
tp2 4.1e-5 on layer 1's A_log (one element 1.2e-7 apart, of a norm of 2.9e-3), dp2 1.9e-6. The text model alone
(k3_tiny, data=embedded, the same settings) measures 1.03e-5 under tp2 on an AttnRes query: the rounding floor of
those tensors, not the tower's. With AdamW's default eps
1e-8 instead of 1e-6, dp2 measures 1.29e-5 on an AttnRes query (AdamW takes a unit step on elements whose gradient
cancels to rounding noise; helpers.FAST explains it); the tower's parameters stay <= 1.44e-6 there too."""

import pytest
import torch
from dist_utils import run_distributed
from helpers import TINY, ZERO_INIT, ZERO_INIT_RTOL, full_params, one_process
from trajectory import compare, record

pytestmark = pytest.mark.slow

VL = ["model=k3_vl_tiny", "data=multimodal"] + TINY + [
    "train.micro_batch_size=1", "train.global_batch_size=4", "train.eval_interval=0", "optim.warmup_steps=2",
    "optim.eps=1e-6", "logging.wandb.mode=disabled"]  # eps: AdamW's, for the vectors (helpers.FAST says why)
STEPS = 5
RTOL = 1e-5
PARAM_RTOL = 1e-5  # every tensor but ZERO_INIT's (tests/helpers.py: vectors that start at zero, ZERO_INIT_RTOL)


def _train(rank, world, overrides, run_dir):
    from megatron_k3.config import compose_run_config
    from megatron_k3.training.engine import shutdown
    from megatron_k3.training.loop import Trainer

    run, _, _ = compose_run_config(VL + overrides, world_size=world)
    try:
        trainer = Trainer(run, f"{run_dir}/{rank}")
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        steps = record(trainer, STEPS, full_params)
        moved = {n: not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters()}
        return steps, moved
    finally:
        shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return one_process(_train, tmp_path_factory)


def test_one_process_trains_every_vision_parameter(reference):
    steps, moved = reference
    tower = [n for n in moved if n.startswith(("vision_tower.", "mm_projector."))]
    assert len(tower) == 18 and all(moved[n] for n in tower)
    assert steps[-1].loss < steps[0].loss


@pytest.mark.parametrize("world,overrides", [
    (2, ["parallel.tp=2"]),
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    (2, ["parallel.zero_stage=1"]),
    (2, ["parallel.pp=2", "parallel.zero_stage=1"]),
], ids=["tp2", "tp2-sp", "dp2", "pp2"])
def test_vision_layouts_equal_one_process(reference, tmp_path, world, overrides):
    ref_steps, _ = reference
    held = set()
    for rank, (steps, _) in enumerate(run_distributed(_train, world, overrides, str(tmp_path), timeout=300)):
        compared = compare(ref_steps, steps, RTOL, ZERO_INIT_RTOL, f"rank {rank}")
        got, ref = steps[compared - 1].params, ref_steps[compared - 1].params
        for n, p in got.items():  # everything but the zero-initialised AdamW vectors at PARAM_RTOL
            if not n.endswith(ZERO_INIT):
                err = ((p - ref[n]).norm() / ref[n].norm()).item()
                assert err < PARAM_RTOL, (rank, n, err)
        held |= set(steps[-1].params)
    assert held == set(ref_steps[-1].params)
    if "parallel.pp=2" in overrides:  # the tower lives with the embedding
        stage1 = set(steps[-1].params)
        assert not any(n.startswith(("vision_tower.", "mm_projector.")) for n in stage1)


def test_freeze_vision_keeps_the_tower_and_trains_the_rest(tmp_path):
    steps, moved = run_distributed(_train, 1, ["model.freeze_vision=true"], str(tmp_path), timeout=300)[0]
    tower = [n for n in moved if n.startswith(("vision_tower.", "mm_projector."))]
    assert tower and not any(moved[n] for n in tower)
    assert moved["model.embed_tokens.weight"] and moved["lm_head.weight"]


def test_a_sample_unreadable_mid_run_stops_after_a_checkpoint_and_resumes(tmp_path):
    """data=multimodal from JSON lines: an image deleted after the start-up scan stops the run at the step that
    reads it, with one line naming the document, after saving the last completed step; a run with the file back
    resumes from there and matches an uninterrupted run bit for bit."""
    import json

    import numpy as np
    from PIL import Image

    from megatron_k3.config import compose_run_config
    from megatron_k3.errors import DataError
    from megatron_k3.training.engine import shutdown
    from megatron_k3.training.loop import Trainer

    rng = np.random.default_rng(0)
    lines = []
    for i in range(30):
        Image.fromarray(rng.integers(0, 256, (28 + 14 * (i % 3), 42, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
        lines.append(json.dumps({"text": f"Picture {i}: <image> is noise number {i}.", "images": [f"{i}.png"]}))
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    args = [a for a in VL if not a.startswith("logging")] + [
        f"data.paths=[{tmp_path / 'd.jsonl'}]", "data.split='90,10,0'", "train.steps=4", "train.save_interval=0",
        "logging.wandb.mode=disabled", f"checkpoint.dir={tmp_path / 'ckpt'}"]

    def losses(run_dir, steps, resume=False):
        run, _, _ = compose_run_config(args + (["checkpoint.load=auto"] if resume else []), world_size=1)
        trainer = Trainer(run, run_dir)
        try:
            if resume:
                trainer.maybe_resume()
            return [trainer.train_step()[0]["loss"] for _ in range(steps)], trainer
        finally:
            shutdown()

    straight, _ = losses(tmp_path / "a", 4)
    run, _, _ = compose_run_config(args, world_size=1)
    trainer = Trainer(run, tmp_path / "b")
    try:
        first = [trainer.train_step()[0]["loss"] for _ in range(2)]
        read = [int(d) for c in range(trainer.pos.consumed, trainer.pos.consumed + 4)
                for d in trainer.train_ds.documents_of(c)]
        gone = tmp_path / f"{int(trainer.train_ds.doc_ids[read[0]])}.png"
        gone.rename(tmp_path / "moved")
        with pytest.raises(DataError, match=r"d\.jsonl:\d+"):
            trainer.train_step()
    finally:
        shutdown()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")) == ["step_00000002"]
    (tmp_path / "moved").rename(gone)
    rest, _ = losses(tmp_path / "c", 2, resume=True)
    assert first + rest == straight
