import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|: the relative error measure used across the suite."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.fixture
def rel():
    return rel_err


# The 4-layer K3 of tests/test_train.py (KDA x3 + MLA, MoE, AttnRes in blocks of 2, 64-token sequences), logging
# every W&B media step: the short real run whose metrics.jsonl the observability and plot tests read.
OBS_FAST = ["model.num_layers=4", "model.hidden_size=64", "model.dense_intermediate_size=128",
            "model.attn_res_block_size=2", "train.seq_length=64", "train.micro_batch_size=2",
            "train.global_batch_size=4", "train.eval_interval=2", "train.eval_iters=1", "optim.warmup_steps=3",
            "logging.wandb.mode=disabled", "logging.wandb.media_interval=2", "train.save_interval=0"]


@pytest.fixture(scope="session")
def short_run_dir(tmp_path_factory):
    """A 3-step training run shared by every test that reads what a run writes (run once per session)."""
    from megatron_k3.train import main

    d = tmp_path_factory.mktemp("short_run")
    assert main(OBS_FAST + ["train.steps=3", f"hydra.run.dir={d}"]) == 0
    return d
