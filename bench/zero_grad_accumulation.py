#!/usr/bin/env python
"""How DeepSpeed's ZeRO-1 and ZeRO-2 hand a step's gradient to the optimizer under bf16 weights with
precision.grad_accum_dtype=fp32 (the default): the Muon matrices' and the AdamW half's, against the float64 sum of
the same micro-batches' bf16 gradients, over `--micro-batches` micro-batches per step. Two setups side by side:
"deepspeed", DeepSpeed 0.19.8's own handling (its gradient reduction in the weights' dtype, bf16; the Muon groups'
reduced gradients kept in a bf16 buffer, ZeRO-2's buckets bf16), and "ours", as the Trainer runs it
(megatron_k3.training.engine sets `communication_data_type` to precision.grad_accum_dtype; optim.zero.attach keeps
that buffer and ZeRO-2's buckets in fp32).

One process here (dp = 1: every element is in the rank's partition; `zero_gradients` and `reference` also take
data-parallel ranks, which tests/test_muon_distributed.py runs at dp = 2), a 2-layer k3_tiny,
DeepSpeed set up as the Trainer sets it up (megatron_k3.training.engine: ZeRO's optimizer for both stages, our
ZeroMuon attached). The Muon matrices' gradient is what `attach`'s deferred update receives (the whole matrix), the
AdamW half's what ZeroMuon's step gets (the group's flat fp32 partition). The reference runs the same bf16 model one
micro-batch at a time and adds each bf16 gradient in float64, so the error is the accumulation's and the reduction's.
Reported: the relative error (|g - ref| / |ref|) of each tensor, median and max over the Muon matrices, and over the
AdamW groups' flat partitions.

    .venv/bin/python bench/zero_grad_accumulation.py [--micro-batches 8 32 128] [--port 29611]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_k3.optim.zero as zero_module  # noqa: E402
from megatron_k3.config import load_model_config  # noqa: E402
from megatron_k3.config.schema import OptimConfig  # noqa: E402
from megatron_k3.model import K3ForCausalLM  # noqa: E402
from megatron_k3.optim import build_optimizer  # noqa: E402
from megatron_k3.optim.zero import ZeroMuon, attach  # noqa: E402
from megatron_k3.training.engine import _zero_optimizer_for_every_stage  # noqa: E402

MODEL = ["model.num_layers=2", "model.attn_res_block_size=2"]


def _model():
    torch.manual_seed(0)
    return K3ForCausalLM(load_model_config("k3_tiny", MODEL))


def _batches(n: int, rank: int = 0, world: int = 1) -> list:
    """Data-parallel rank `rank`'s n micro-batches of a step of n * world."""
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 8192, (1, 64), generator=g) for _ in range(n * world)][rank * n:(rank + 1) * n]


def reference(n: int, world: int = 1) -> dict:
    """{name: float64 sum of the step's micro-batches' bf16 gradients of loss / n, over `world` data-parallel ranks'
    n each, divided by world} (DeepSpeed scales each loss by 1/n and averages over data parallel)."""
    model = _model().to(torch.bfloat16)
    ref = {name: torch.zeros(p.shape, dtype=torch.float64) for name, p in model.named_parameters()}
    for ids in _batches(n * world):
        model.zero_grad()
        (model(ids, labels=ids).loss / n).backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                ref[name] += p.grad.double()
    return {name: r / world for name, r in ref.items()}


def zero_gradients(n: int, stage: int, ours: bool, rank: int = 0, world: int = 1) -> tuple:
    """({Muon matrix name: the gradient its update got}, [(AdamW group's flat fp32 partition gradient, its
    parameters' names, the partition's offset in their concatenation)]) of one step of n micro-batches on each of
    `world` data-parallel ranks (this process is `rank` of an initialised process group) under ZeRO-`stage`, as the
    Trainer runs it (`ours`) or with DeepSpeed's own reduction dtype and Muon gradient buffer."""
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # plain gloo collectives, no C++ build
    model = _model()
    names = {id(p): name for name, p in model.named_parameters()}
    opt = build_optimizer(model, OptimConfig(name="muon", lr=0.0, weight_decay=0.0, ns_dtype="fp32"),
                          muon_class=ZeroMuon)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": n, "bf16": {"enabled": True},
              "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": stage},
              "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
    if ours:
        config["communication_data_type"] = "fp32"
    with _zero_optimizer_for_every_stage():
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
    fp32_buffer = zero_module._fp32_muon_gradient_buffer
    if not ours:
        zero_module._fp32_muon_gradient_buffer = lambda zero: None
    try:
        attach(engine)
    finally:
        zero_module._fp32_muon_gradient_buffer = fp32_buffer
    zero, muon, adamw = engine.optimizer, {}, []
    index = {id(g): i for i, g in enumerate(opt.param_groups)}  # ZeRO steps one group at a time, alone in the list
    run_pending, adamw_step = opt.run_pending_updates, opt._adamw_step

    def record_muon(scale):
        for todo in opt.pending.values():
            for p, grad, _ in todo:
                muon[names[id(p)]] = grad.double().clone()
        return run_pending(scale)

    def record_adamw(p, group):
        gi = index[id(group)]
        adamw.append((p.grad.double().clone(), [names[id(q)] for q in zero.bit16_groups[gi]], rank * p.numel()))
        return adamw_step(p, group)

    opt.run_pending_updates, opt._adamw_step = record_muon, record_adamw
    for ids in _batches(n, rank, world):
        engine.backward(engine(ids, labels=ids).loss)
        engine.step()
    return muon, adamw


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def errors(ref: dict, muon: dict, adamw: list) -> tuple:
    """(sorted relative errors of the Muon matrices, of the AdamW groups' partitions) against `reference`."""
    m = sorted(_rel(g, ref[name]) for name, g in muon.items() if ref[name].norm() > 0)
    a = []
    for g, names, start in adamw:
        whole = torch.cat([ref[name].flatten() for name in names])[start:start + g.numel()]
        if whole.norm() > 0:
            a.append(_rel(g[:whole.numel()], whole))
    return m, a


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--port", type=int, default=29611)
    args = ap.parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    print("| micro-batches | ZeRO | setup | Muon matrices: median | max | AdamW half: max |")
    print("|---|---|---|---|---|---|")
    for n in args.micro_batches:
        ref = reference(n)
        for stage, ours in ((1, False), (1, True), (2, False), (2, True)):
            errs, flat = errors(ref, *zero_gradients(n, stage, ours))
            print(f"| {n} | {stage} | {'ours' if ours else 'deepspeed'} | {errs[len(errs) // 2]:.2e} | {errs[-1]:.2e} "
                  f"| {max(flat):.2e} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
