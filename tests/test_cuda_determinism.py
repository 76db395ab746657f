"""train.deterministic on CUDA: torch.use_deterministic_algorithms(True) raises on every op whose only CUDA kernel is
nondeterministic (torch 2.13's list, in that function's docstring), so a GPU run would stop at the first such op.
No GPU here: a dispatch mode stands in for CUDA's check and names each such op a CPU step runs (the same aten ops
run on either device, the backward's included, except what only CUDA runs: fla's fused KDA kernel, the offload's
streams). A step of the vision-language model with Quantile Balancing's
histogram estimator ran two: F.interpolate's backward (the tower's position table) and a floating-point cumsum (the
quantile's bin counts); neither runs now (model.vision.interpolate_table, training.balancing)."""

import pytest
import torch
from dist_utils import run_distributed
from helpers import FULL_VOCAB, make_trainer
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def _any(args, kwargs):
    return True


def _floating(args, kwargs):
    """cumsum's result is floating point (torch checks the result's type: an integer input with dtype=float too)."""
    dtype = kwargs.get("dtype", args[2] if len(args) > 2 else None)
    if dtype is not None:
        return dtype.is_floating_point or dtype.is_complex
    return args[0].is_floating_point() or args[0].is_complex()


def _weighted(args, kwargs):
    return (len(args) > 1 and args[1] is not None) or kwargs.get("weights") is not None


def _prod(args, kwargs):
    return (args[4] if len(args) > 4 else kwargs.get("reduce")) == "prod"


# torch.use_deterministic_algorithms: "will throw a RuntimeError when mode=True" on CUDA (resize_ of quantized
# tensors left out: no quantized tensors here)
ALERTS = {
    **{op: _any for op in (
        aten.avg_pool3d_backward, aten._adaptive_avg_pool2d_backward, aten._adaptive_avg_pool3d_backward,
        aten.adaptive_max_pool2d_backward, aten.fractional_max_pool2d_backward, aten.fractional_max_pool3d_backward,
        aten.max_unpool2d, aten.max_unpool3d, aten.upsample_linear1d_backward, aten.upsample_bilinear2d_backward,
        aten.upsample_bicubic2d_backward, aten.upsample_trilinear3d_backward, aten.reflection_pad1d_backward,
        aten.reflection_pad2d_backward, aten.reflection_pad3d_backward, aten.nll_loss2d_forward,
        aten._ctc_loss_backward, aten._embedding_bag_backward, aten._embedding_bag_dense_backward, aten.put_,
        aten.put, aten.histc, aten.grid_sampler_2d_backward, aten.grid_sampler_3d_backward)},
    aten.median: lambda args, kwargs: len(args) > 1 or "dim" in kwargs,  # with indices
    aten.nanmedian: lambda args, kwargs: len(args) > 1 or "dim" in kwargs,
    aten.bincount: _weighted,
    aten.cumsum: _floating,
    aten.cumsum_: _floating,
    aten.scatter_reduce: _prod,
    aten.scatter_reduce_: _prod,
}


class CudaDeterminismAlerts(TorchDispatchMode):
    """Records the ops CUDA's deterministic mode would stop at (`seen`), and runs them."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check = ALERTS.get(func.overloadpacket)
        if check is not None and check(args, kwargs):
            self.seen.append(str(func))
        return func(*args, **kwargs)


def test_the_stand_in_names_what_cuda_refuses_and_nothing_else():
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    with CudaDeterminismAlerts() as mode:
        torch.nn.functional.interpolate(x, size=(6, 5), mode="bilinear").sum().backward()
        torch.randn(8).cumsum(0)
        torch.arange(8).cumsum(0, dtype=torch.float32)  # an integer input summed as floats
        torch.histc(torch.randn(8))
        torch.bincount(torch.tensor([0, 2]), weights=torch.ones(2))
        torch.randn(3, 4).median(1)
        flagged = list(mode.seen)
        mode.seen.clear()
        torch.arange(8).cumsum(0)  # integers: exact in any order, no alert
        torch.bincount(torch.tensor([0, 2]))
        torch.zeros(3).index_add_(0, torch.tensor([0, 0]), torch.ones(2))
        torch.randn(3, 4).median()
    assert [f.split(".")[1] for f in flagged] == ["upsample_bilinear2d_backward", "cumsum", "cumsum", "histc",
                                                  "bincount", "median"], flagged
    assert mode.seen == [], mode.seen


def _steps_under_the_stand_in(rank, world, overrides, run_dir):
    from megatron_k3.training.engine import shutdown

    try:
        trainer = make_trainer(world, overrides, steps=2, run_dir=f"{run_dir}/{rank}")
        with CudaDeterminismAlerts() as mode:
            for _ in range(2):
                trainer.train_step()
            trainer.evaluate()
        return mode.seen, len(trainer.balancers)
    finally:
        shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("world,overrides", [
    (1, ["model=k3_vl_tiny", "data=multimodal", FULL_VOCAB, "moe.quantile_estimator=histogram",
         "train.recompute=selective", "train.tile_tokens=32"]),
    (2, ["parallel.ep=2", "model.moe_overflow=balanced", "train.recompute=selective", "train.tile_tokens=32"]),
    (2, ["parallel.cp=2", "train.recompute=full", "train.offload_buffer_gb=1"]),
], ids=["vision_histogram", "ep2_balanced", "cp2_offload"])
def test_a_step_runs_no_op_cuda_refuses_under_train_deterministic(tmp_path, world, overrides):
    """Under train.deterministic: two steps and an evaluation (forward, backward, balancer and optimizer) of
    k3_vl_tiny on image-text data with Quantile Balancing by histogram, selective recomputation and token tiles; the
    balanced expert dispatch over ep2; context parallelism with the layer inputs offloaded."""
    results = run_distributed(_steps_under_the_stand_in, world, overrides + ["train.deterministic=true"],
                              str(tmp_path), timeout=300)
    for seen, balancers in results:
        assert balancers > 0
        assert seen == [], sorted(set(seen))
