"""Tensor (and sequence) parallel K3 equals the single-process model: first-step gradients of every
parameter, and losses and parameters after SGD steps (gloo workers)."""

import pytest
import torch
from dist_utils import run_distributed
from helpers import max_abs_rel

from megatron_k3.annotations import meta
from megatron_k3.config import load_model_config
from megatron_k3.model import K3ForCausalLM

pytestmark = pytest.mark.slow  # multi-process worlds or training runs

OVERRIDES = ["num_layers=4", "hidden_size=64", "dense_intermediate_size=128", "attn_res_block_size=2"]
RTOL = 1e-5  # fp32: partial sums of sharded matmuls are added in a different order (losses, first-step gradients)
# parameters after 3 SGD steps at lr 0.5: each step adds lr x the gradient's rounding difference, and the runs'
# gradients then differ a little more at every step (largest element relative to the tensor's largest, measured
# over init seeds 0-3 and the three layouts: gradients <= 4.4e-6, parameters <= 1.4e-5, losses <= 2.2e-7)
PARAM_RTOL = 5e-5


def _data(dp_rank=0, dp=1):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 8192, (dp, 96), generator=g)[dp_rank:dp_rank + 1]
    return ids, ids.roll(-1, 1), torch.tensor([0, 20, 64, 96])


def _grads(model):
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in model.named_parameters()}


def _train(model, steps, dp_group=None, dp_rank=0, dp=1):
    ids, labels, cu = _data(dp_rank, dp)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, first_grads = [], None
    for step in range(steps):
        loss = model(ids, labels=labels, cu_seqlens=cu).loss
        loss.backward()
        if dp > 1:
            for p in model.parameters():
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad, group=dp_group)
                    p.grad.div_(dp)
            torch.distributed.all_reduce(loss := loss.detach().clone(), group=dp_group)
            loss = loss / dp
        if step == 0:
            first_grads = _grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, first_grads


def _full(model, tensors, group, size):
    out = {}
    for n, p in model.named_parameters():
        t = tensors[n]
        d = meta(p).tp_dim
        if d is not None and size > 1:
            parts = [torch.empty_like(t) for _ in range(size)]
            torch.distributed.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, d)
        out[n] = t
    return out


def _worker(rank, world, tp, sp, steps, seed=0):
    from megatron_k3.parallel import ParallelGroups, parallelize, state

    ps = state.initialize_model_parallel(tp=tp)
    try:
        torch.manual_seed(seed)
        model = parallelize(K3ForCausalLM(load_model_config("k3_tiny", OVERRIDES)), ParallelGroups.from_state(ps, sp))
        dp, dp_rank = state.get_data_parallel_world_size(), state.get_data_parallel_rank()
        losses, grads = _train(model, steps, state.get_data_parallel_group(), dp_rank, dp)
        g = state.get_tensor_model_parallel_group()
        grads = _full(model, grads, g, tp)
        params = _full(model, {n: p.detach() for n, p in model.named_parameters()}, g, tp)
        return losses, grads, params
    finally:
        state.destroy_model_parallel()


def _reference(steps, dp, seed=0):
    torch.manual_seed(seed)
    model = K3ForCausalLM(load_model_config("k3_tiny", OVERRIDES))
    ids, labels, cu = _data(0, dp)
    if dp > 1:  # the same global batch in one process: DP ranks hold one row each
        all_ids = torch.cat([_data(r, dp)[0] for r in range(dp)])
        all_labels = torch.cat([_data(r, dp)[1] for r in range(dp)])
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses, first = [], None
        for step in range(steps):
            loss = sum(model(all_ids[r:r + 1], labels=all_labels[r:r + 1], cu_seqlens=cu).loss for r in range(dp)) / dp
            loss.backward()
            if step == 0:
                first = _grads(model)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return losses, first, {n: p.detach() for n, p in model.named_parameters()}
    losses, first = _train(model, steps)
    return losses, first, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world,tp,sp", [(2, 2, False), (2, 2, True), (4, 2, True)])
def test_tensor_parallel_equals_single_process(world, tp, sp):
    steps = 3
    dp = world // tp
    ref_losses, ref_grads, ref_params = _reference(steps, dp)
    results = run_distributed(_worker, world, tp, sp, steps, timeout=240)
    for losses, grads, params in results[:1] + results[-1:]:
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= RTOL * abs(b), (losses, ref_losses)
        worst = max((max_abs_rel(grads[n], g, floor=1e-12, float64=False), n) for n, g in ref_grads.items()
                    if g.abs().max() > 0)
        assert worst[0] < RTOL, worst
        worst = max((max_abs_rel(params[n], p, floor=1e-12, float64=False), n) for n, p in ref_params.items())
        assert worst[0] < PARAM_RTOL, worst
