"""The DeepSpeed engine under every dense layout equals the single-process run: per-step losses of 5 AdamW steps
of k3_tiny (fp32) and every parameter afterwards, through the real Trainer (gloo workers).

Losses: 1e-5 relative (fp32; measured <= 8e-8). Parameters: per tensor ||a - b|| / ||b|| <= PARAM_RTOL. AdamW
turns fp32 rounding differences into larger parameter differences: an element whose gradient is dominated by
rounding noise moves by up to lr * noise / (sqrt(v) + eps). Any change of summation order does this, even in
one process: re-splitting the same global batch into 2 micro-batches of 2 instead of 4 of 1 (the "one-process"
case below) moves parameters by 3.0e-6 (norm) / 2.8e-4 (max element, relative to the tensor's max). Measured for
the layouts (k3_tiny, lr 3e-3, optim.eps 1e-6, init seed of train.seed; steps compared as tests/trajectory.py
decides: a near-tie routing flip at step 5 under tp2 stops the strict comparison after step 4): dp=2 ZeRO-1
3.2e-6 / 1.1e-4, ZeRO-2 4.2e-6 / 1.8e-4 (5 steps), tp=2 x dp=2 ZeRO-1 and ZeRO-2 3.1e-5 / 1.6e-3, tp=2+SP 3.0e-5 /
1.5e-3 (4 steps; tensor parallelism also reorders the forward's matmul sums); losses within 8e-8. On a machine
where no routing flips (AVX-512 EPYC, 2026-12-03) all 5 steps compare, and every tp2 layout (tp2 x dp2, tp2+SP,
tp2 x ep2, pp2 x tp2) ends 6.5e-5 .. 8.1e-5 apart, on a KDA layer's A_log: 2 elements (one per head) that start at
0, so the tensor is nothing but five AdamW steps, whose normalisation turns rounding into 2e-7 of its ~3e-3;
PARAM_RTOL is 2e-4 for that. A wrong reduction (a missing average, a gradient reduced over the wrong group) is off
by O(1).
"""

import pytest
from deepspeed.runtime import engine as ds_engine
from dist_utils import run_distributed
from helpers import FAST, PARAM_RTOL, RTOL, norm_rel, one_process, train_layout, train_layout_default_optimizer
from trajectory import compare

from megatron_k3.layout import ZERO0_ALLREDUCE_BUCKET

# The run (helpers.train_layout: FAST, STEPS steps through the real Trainer) and the tolerances are in tests/helpers.py,
# which the other layout tests share.


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return one_process(train_layout, tmp_path_factory)


@pytest.mark.parametrize("world,overrides,optimizer", [
    (2, ["parallel.zero_stage=1"], "DeepSpeedZeroOptimizer"),
    (2, ["parallel.zero_stage=2"], "DeepSpeedZeroOptimizer"),
    (4, ["parallel.tp=2", "parallel.zero_stage=1"], "DeepSpeedZeroOptimizer"),
    (4, ["parallel.tp=2", "parallel.zero_stage=2"], "DeepSpeedZeroOptimizer"),
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true"], "DeepSpeedZeroOptimizer"),
    (2, ["parallel.zero_stage=0"], "AdamW"),
    (1, ["train.micro_batch_size=2"], "DeepSpeedZeroOptimizer"),
], ids=["dp2-zero1", "dp2-zero2", "tp2xdp2-zero1", "tp2xdp2-zero2", "tp2-sp", "dp2-zero0", "one-process"])
@pytest.mark.slow
def test_layout_equals_single_process(reference, tmp_path, world, overrides, optimizer):
    """Losses and parameters step by step up to the first routing decision that a near-tie let go the other way
    (tests/trajectory.py); the routing itself equal everywhere else."""
    ref_steps = reference[3]["steps"]
    results = run_distributed(train_layout, world, overrides, str(tmp_path), timeout=300)
    for rank, (_, _, opt_name, extra) in enumerate(results):
        assert opt_name == optimizer
        compare(ref_steps, extra["steps"], RTOL, PARAM_RTOL, f"rank {rank}")


@pytest.fixture(scope="module")
def reference_default(tmp_path_factory):
    return one_process(train_layout_default_optimizer, tmp_path_factory, name="ref_default")


@pytest.mark.parametrize("world,overrides", [
    (2, ["parallel.zero_stage=1"]),
    (4, ["parallel.tp=2", "parallel.zero_stage=2"]),
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
], ids=["dp2-zero1", "tp2xdp2-zero2", "tp2-sp"])
@pytest.mark.slow
def test_layout_equals_single_process_with_the_default_optimizer(reference_default, tmp_path, world, overrides):
    """What a user gets without optim=...: every parameter within 2e-5 relative (per tensor, in norm) after 5 steps
    (measured with the K3 configs' MLA latent-norm eps 1e-6: dp2 ZeRO-1 4.0e-6, ZeRO-2 1.4e-6, tp2 x dp2 ZeRO-1
    1.05e-5, ZeRO-2 1.05e-5, tp2+SP 1.04e-5, the losses within 8e-8; with eps 1e-5 the tp layouts measured 3.8e-6).
    The worst tensor is layer 0's AttnRes query (`mlp_res.proj`, a vector AdamW updates): AdamW's per-element
    normalisation turns the rounding of an element whose gradient nearly cancels into a step of its own, and
    tensor parallelism sums the gradients in another order. Muon's orthogonalised update does not amplify rounding
    noise that way."""
    ref_losses, ref_params, _, _ = reference_default
    for rank, (losses, params, _, _) in enumerate(
            run_distributed(train_layout_default_optimizer, world, overrides, str(tmp_path), timeout=300)):
        for step, (a, b) in enumerate(zip(losses, ref_losses), 1):
            assert abs(a - b) <= RTOL * abs(b), (rank, step, losses, ref_losses)
        worst = max((norm_rel(params[n], p), n) for n, p in ref_params.items())
        assert worst[0] < 2e-5, (rank, worst)


def test_generated_deepspeed_config():
    from megatron_k3.config import ConfigError, compose_run_config
    from megatron_k3.planning.run import workload
    from megatron_k3.training.engine import deepspeed_config

    run, _, _ = compose_run_config(FAST + ["train.global_batch_size=16", "train.micro_batch_size=2",
                                           "parallel.zero_stage=2", "precision=bf16",
                                           "parallel.overlap_grad_reduce=true",
                                           "+parallel.deepspeed.zero_optimization.reduce_bucket_size=4096"],
                                   world_size=4)
    cfg = deepspeed_config(run, dp=4)
    assert cfg["train_batch_size"] == 16 and cfg["train_micro_batch_size_per_gpu"] == 2
    assert cfg["gradient_accumulation_steps"] == 2 and cfg["gradient_clipping"] == run.train.grad_clip
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["zero_optimization"]["overlap_comm"] is True
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 4096  # a merged entry; the planner counts it too
    assert workload(run).reduce_bucket == 4096 and workload(run).overlap_grad_reduce
    assert cfg["zero_optimization"]["contiguous_gradients"] is True  # untouched keys of the merged section stay
    # the bucket, otherwise: the model's parameters rounded up to 256 elements, 50M at most (DeepSpeed makes it whole)
    assert deepspeed_config(run, dp=4, num_params=1000)["zero_optimization"]["allgather_bucket_size"] == 1024
    plain = compose_run_config(FAST, world_size=4)[0]
    assert deepspeed_config(plain, dp=4, num_params=1000)["zero_optimization"]["reduce_bucket_size"] == 1024
    assert deepspeed_config(plain, dp=4, num_params=10 ** 9)["zero_optimization"]["reduce_bucket_size"] == 50_000_000
    # ZeRO-0's boundary all-reduce goes by DeepSpeed's own flat copies, which the planner sizes from the same constant
    assert ZERO0_ALLREDUCE_BUCKET == ds_engine.MEMORY_OPT_ALLREDUCE_SIZE
    assert cfg["bf16"] == {"enabled": True} and cfg["data_types"]["grad_accum_dtype"] == "fp32"
    assert cfg["communication_data_type"] == "fp32"  # reduced in the accumulation dtype, as the planner counts it
    # precision.grad_accum_dtype is the one key of the accumulation dtype (the routed experts and the planner read
    # it): DeepSpeed's gets it, and a parallel.deepspeed entry contradicting it is refused at composition, naming both
    bf16_accum = FAST + ["precision=bf16", "precision.grad_accum_dtype=bf16"]
    run, _, _ = compose_run_config(bf16_accum, world_size=4)
    assert deepspeed_config(run, dp=4)["data_types"]["grad_accum_dtype"] == "bf16"
    assert deepspeed_config(run, dp=4)["communication_data_type"] == "bf16"
    with pytest.raises(ConfigError, match=r"parallel\.deepspeed\.data_types\.grad_accum_dtype='fp32'.*precision\."
                                          r"grad_accum_dtype"):
        compose_run_config(bf16_accum + ["+parallel.deepspeed.data_types.grad_accum_dtype=fp32"], world_size=4)
    # so are the other entries a key of ours sets: the dtype the gradients are reduced in, the ZeRO stage and the
    # overlap (the layout rules, the planner's memory and time models read the keys); equal values are accepted
    for entry, key in (("communication_data_type=fp32", "precision.grad_accum_dtype"),
                       ("zero_optimization.stage=2", "parallel.zero_stage"),
                       ("zero_optimization.overlap_comm=true", "parallel.overlap_grad_reduce")):
        with pytest.raises(ConfigError, match=rf"parallel\.deepspeed\.{entry.split('=')[0]}=.*set {key} instead"):
            compose_run_config(bf16_accum + [f"+parallel.deepspeed.{entry}"], world_size=4)
    compose_run_config(bf16_accum + ["+parallel.deepspeed.communication_data_type=bf16",
                                     "+parallel.deepspeed.zero_optimization.stage=1"], world_size=4)
