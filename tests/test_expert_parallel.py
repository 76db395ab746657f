"""Expert parallelism through the real Trainer equals the single-process run: losses of 5 AdamW steps and every
parameter afterwards (experts gathered in global order), when the capacity admits every token; the router
bias that Quantile Balancing sets after each step is the same too. Tolerances as in test_engine.py."""

import pytest
import torch
from dist_utils import run_distributed
from test_engine import PARAM_RTOL, RTOL, _rel, _train

pytestmark = pytest.mark.slow  # multi-process worlds or training runs

# 16 experts, top-4: capacity factor 4 gives every expert room for every token (C = N)
STATIC = ["model.moe_overflow=drop", "model.moe_capacity_factor=4.0"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_distributed(_train, 1, STATIC, str(tmp_path_factory.mktemp("ref")), timeout=300)[0]


@pytest.mark.parametrize("world,overrides", [
    (2, ["parallel.ep=2"]),
    (2, ["parallel.ep=2", "parallel.zero_stage=2"]),
    (4, ["parallel.ep=2"]),  # ep=2 x dp=2 (dense dp 4, expert dp 2)
    (4, ["parallel.tp=2", "parallel.ep=2"]),
    (4, ["parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true"]),
    (2, ["parallel.ep=2", "model.moe_overflow=dropless"]),
], ids=["ep2", "ep2-zero2", "ep2xdp2", "tp2xep2", "tp2xep2-sp", "ep2-dropless"])
def test_expert_parallel_equals_single_process(reference, tmp_path, world, overrides):
    ref_losses, ref_params, _, ref_extra = reference
    assert all(b.abs().max() > 1e-3 for b in ref_extra["bias"])  # Quantile Balancing did move the bias
    results = run_distributed(_train, world, STATIC + overrides, str(tmp_path), timeout=300)
    for rank, (losses, params, _, extra) in enumerate(results):
        for step, (a, b) in enumerate(zip(losses, ref_losses), 1):
            assert abs(a - b) <= RTOL * abs(b), (rank, step, losses, ref_losses)
        worst = max((_rel(params[n], p), n) for n, p in ref_params.items())
        assert worst[0] < PARAM_RTOL, (rank, worst)
        assert extra["dropped"] == [0.0] * len(extra["dropped"])
        for b, rb in zip(extra["bias"], ref_extra["bias"]):
            assert torch.allclose(b, rb, atol=1e-5), (rank, (b - rb).abs().max())
