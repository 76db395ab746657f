"""training.expert_optimizer in one process: how the routed experts' gradients accumulate over a step's micro-batches
(the multi-process layouts against one process are tests/test_expert_parallel.py)."""

import torch

from megatron_k3.layout.grid import GROUPS, RankGrid
from megatron_k3.parallel.state import ParallelState
from megatron_k3.training.expert_optimizer import ExpertOptimizer


def _one_rank(params) -> ExpertOptimizer:
    ps = ParallelState(RankGrid(1), 0, {name: None for name in GROUPS})
    return ExpertOptimizer(params, lambda ms: torch.optim.SGD([m for _, m in ms], lr=1.0), ps, torch.device("cpu"))


def test_bf16_expert_gradients_accumulate_in_fp32():
    """Under expert parallelism the routed experts are outside DeepSpeed, whose fp32 accumulation (`grad_accum`) is
    for its own parameters. Their micro-batch gradients are added in fp32 as each backward produces them, as
    DeepSpeed and Megatron (main_grad) do for theirs: after 8 micro-batches whose bf16 gradients span four orders of
    magnitude the step's gradient is exactly their fp32 sum in backward order (bit for bit: the same fp32 additions),
    which a bf16 sum misses; a bf16 gradient never outlives its backward. fp32 weights accumulate in .grad as
    before."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 4, 5).bfloat16())
    f = torch.nn.Parameter(torch.randn(2, 3, 4))
    ex = _one_rank([("w", w), ("f", f)])
    want_w, want_f, bf16_sum = torch.zeros(3, 4, 5), torch.zeros(2, 3, 4), torch.zeros(3, 4, 5, dtype=torch.bfloat16)
    for j in range(8):
        scale = 10.0 ** (j % 4 - 2)
        cw, cf = (torch.randn(3, 4, 5) * scale).bfloat16(), torch.randn(2, 3, 4) * scale
        ((w * cw).float().sum() + (f * cf).sum()).backward()  # gradients: cw (bf16), cf
        assert w.grad is None and ex.main_grads[0].dtype == torch.float32
        assert f.grad is not None and ex.main_grads[1] is None  # fp32: autograd's own accumulation
        want_w += cw.float()
        want_f += cf
        bf16_sum += cw
    assert not torch.equal(bf16_sum.float(), want_w)  # what accumulating in the weights' dtype would have given
    ex.reduce_gradients()
    assert torch.equal(ex.masters[0].grad, want_w) and torch.equal(ex.masters[1].grad, want_f)
    assert w.grad is None and f.grad is None and ex.main_grads == [None, None]
    assert float(ex.sq_norm) == float(sum(t.double().square().sum() for t in (want_w, want_f)))
    before = w.detach().float().clone()
    ex.step(total_norm=1.0, clip=0.0)
    assert torch.equal(w.detach(), (before - want_w).bfloat16())  # SGD, lr 1: the fp32 master, published in bf16


def test_a_skipped_step_drops_the_accumulated_gradients():
    """A skipped step (non-finite gradients, or withheld by train.guard) leaves nothing of its gradients to the next
    step's, reduced (as training.engine.boundary_step does it) or not."""
    w = torch.nn.Parameter(torch.ones(2, 3).bfloat16())
    ex = _one_rank([("w", w)])
    for reduce_first in (True, False):
        (w.float() * float("inf")).sum().backward()
        if reduce_first:
            ex.reduce_gradients()
        ex.skip()
        (w.float() * 2.0).sum().backward()
        ex.reduce_gradients()
        assert torch.equal(ex.masters[0].grad, torch.full((2, 3), 2.0)), reduce_first
        ex.skip()


def test_a_second_optimizer_over_the_same_experts_gets_every_gradient():
    """An ExpertOptimizer built again over the same parameters (a Trainer rebuilt in one process): the first one's
    hooks step aside, so the gradients reach the new one's accumulators, once."""
    w = torch.nn.Parameter(torch.ones(2, 3).bfloat16())
    old, new = _one_rank([("w", w)]), _one_rank([("w", w)])
    (w.float() * 3.0).sum().backward()
    assert old.main_grads == [None] and torch.equal(new.main_grads[0], torch.full((2, 3), 3.0))
