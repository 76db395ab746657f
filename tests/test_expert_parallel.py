"""Expert parallelism through the real Trainer equals the single-process run: losses of 5 AdamW steps and every
parameter afterwards (experts gathered in global order), when the capacity admits every token; the router
bias that Quantile Balancing sets after each step is the same too. Tolerances as in test_engine.py."""

import pytest
import torch
from dist_utils import run_distributed
from helpers import PARAM_RTOL, RTOL, STATIC, one_process, train_layout, train_layout_default_optimizer
from trajectory import compare

pytestmark = pytest.mark.slow  # multi-process worlds or training runs

# STATIC (tests/helpers.py): every expert has room for every token. The one-process run with it is conftest's
# reference_static, which test_context_parallel compares with too.


@pytest.mark.parametrize("world,overrides", [
    (2, ["parallel.ep=2"]),
    (2, ["parallel.ep=2", "parallel.zero_stage=2"]),
    (4, ["parallel.ep=2"]),  # ep=2 x dp=2 (dense dp 4, expert dp 2)
    (4, ["parallel.tp=2", "parallel.ep=2"]),
    (4, ["parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true"]),
    (2, ["parallel.ep=2", "model.moe_overflow=dropless"]),
], ids=["ep2", "ep2-zero2", "ep2xdp2", "tp2xep2", "tp2xep2-sp", "ep2-dropless"])
def test_expert_parallel_equals_single_process(reference_static, tmp_path, world, overrides):
    _, _, _, ref_extra = reference_static
    assert all(b.abs().max() > 1e-3 for b in ref_extra["bias"])  # Quantile Balancing did move the bias
    results = run_distributed(train_layout, world, STATIC + overrides, str(tmp_path), timeout=300)
    for rank, (_, _, _, extra) in enumerate(results):
        # losses and parameters step by step, up to a routing decision a near-tie let go the other way
        compared = compare(ref_extra["steps"], extra["steps"], RTOL, PARAM_RTOL, f"rank {rank}")
        assert extra["dropped"] == [0.0] * len(extra["dropped"])
        if compared == len(extra["steps"]):  # the selection bias QB set after the last step
            for b, rb in zip(extra["bias"], ref_extra["bias"]):
                assert torch.allclose(b, rb, atol=1e-5), (rank, (b - rb).abs().max())


@pytest.fixture(scope="module")
def reference_dropless(tmp_path_factory):
    """One process, dropless routing, the default optimizer (Per-Head Muon + AdamW)."""
    return one_process(train_layout_default_optimizer, tmp_path_factory, ["model.moe_overflow=dropless"],
                       name="ref_dropless")


@pytest.mark.parametrize("world,overrides", [
    (2, ["parallel.ep=2"]),
    (4, ["parallel.tp=2", "parallel.ep=2", "moe.replica_exchange=step"]),
], ids=["ep2", "tp2xep2-step-exchange"])
def test_balanced_expert_parallel_equals_single_process_dropless(reference_dropless, tmp_path, world, overrides):
    """model.moe_overflow=balanced: every EP rank computes exactly the same number of pairs (the logged
    expert_load.rank_max_over_mean is 1), nothing is dropped, and the run equals one process with dropless routing
    after 5 steps of the default optimizer, QB on: losses 1e-5 relative (measured <= 8e-8), every parameter 2e-5 per
    tensor in norm, the bound test_engine holds the dense layouts to with this optimizer. Measured: ep2 2.2e-6, tp2 x
    ep2 8.6e-6 (with moe.replica_exchange=step or without) on an AVX-512 EPYC, 1.17e-5 on an AMX Xeon (2026-12-05:
    other kernels, another rounding); the MoE layers' router, latent projections, shared and routed experts
    <= 6.5e-7; the worst tensor is always an AttnRes query (`*_res.proj`, a vector AdamW updates), the noisiest for
    the reason test_engine's docstring gives: the dense tp2 layout alone measures 1.05e-5 there, so these layouts sit
    at that floor, which a wrong dispatch or reduction (off by O(1)) is far above."""
    ref_steps = reference_dropless[3]["steps"]
    results = run_distributed(train_layout_default_optimizer, world, ["model.moe_overflow=balanced"] + overrides,
                              str(tmp_path), timeout=300)
    for rank, (_, _, _, extra) in enumerate(results):
        assert compare(ref_steps, extra["steps"], RTOL, 2e-5, f"rank {rank}") == len(ref_steps)
        assert extra["dropped"] == [0.0] * len(extra["dropped"])
        for s in extra["steps"]:
            load = s.record["expert_load"]
            assert load["rank_max_over_mean"] == 1.0 and load["dropped_frac"] == 0.0, load


# (2 experts take top-2, every token to both. With top-1 the router has no gradient in exact arithmetic -- one chosen
# score renormalised is 1 -- so its gradient is fp32 rounding noise, which Muon's normalisation (optim/muon.py
# newton_schulz) turns into a full-size update: one process with micro-batches of 2 instead of 1 moves the router by
# 2.5e-3 after step 1 (every other tensor <= 2.4e-6), and any layout routes differently by step 3, with no near-tie
# tests/trajectory.py could see. AdamW's eps keeps such noise small; K3's top-16 has a real router gradient.)
@pytest.mark.parametrize("experts,top_k", [(6, 2), (2, 2)], ids=["blocks-2-1", "blocks-1-0"])
def test_expert_optimizer_blocks_of_any_size_equal_single_process(tmp_path_factory, experts, top_k):
    """training.expert_optimizer shards the routed experts' fp32 masters and optimizer states over expert data
    parallelism in blocks of whole experts (layout.expert_block): on 4 ranks with ep=2 (edp 2) an EP rank's 3 experts
    split 2 + 1, and its 1 expert 1 + 0 (one edp rank steps nothing; the reduce-scatter and all-gather run over
    experts padded to equal blocks). With the default optimizer (Per-Head Muon orthogonalises each expert whole
    where its block is stepped) the run equals one process: losses 1e-5 relative, parameters 2e-5 per tensor (the
    dense layouts' floor with this optimizer, tests/test_engine.py)."""
    model = STATIC + [f"model.num_experts={experts}", f"model.top_k={top_k}"]
    ref = one_process(train_layout_default_optimizer, tmp_path_factory, model, name=f"ref_{experts}")
    results = run_distributed(train_layout_default_optimizer, 4, model + ["parallel.ep=2"],
                              str(tmp_path_factory.mktemp(f"ep2_{experts}")), timeout=300)
    for rank, (_, _, _, extra) in enumerate(results):
        assert compare(ref[3]["steps"], extra["steps"], RTOL, 2e-5, f"rank {rank}") == len(extra["steps"])
