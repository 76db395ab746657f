#!/usr/bin/env python
"""The planner against real k3_tiny runs on this CPU: its memory estimate against the measured peak of live
tensor bytes over two real training steps (megatron_k3.training.loop.Trainer), and its FLOP count against
torch's FlopCounterMode (forward + backward). Prints one row per config; the last column is the ratio
planner / measured.

    .venv/bin/python bench/plan_check.py

Memory is measured with megatron_k3.planning.measure.LiveTensorMemory (a dispatch mode that tracks every
tensor storage from creation to release; torch has no allocator statistics on CPU); the process's peak RSS
is printed beside it for reference (it includes the Python heap, libraries and allocator caching).
"""

from __future__ import annotations

import platform
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from megatron_k3.config import compose_run_config  # noqa: E402
from megatron_k3.model import K3ForCausalLM  # noqa: E402
from megatron_k3.planning.candidates import Layout  # noqa: E402
from megatron_k3.planning.flops import model_flops  # noqa: E402
from megatron_k3.planning.measure import LiveTensorMemory, count_flops  # noqa: E402
from megatron_k3.planning.planner import plan_training  # noqa: E402
from megatron_k3.planning.run import workload  # noqa: E402

CONFIGS = [
    [],
    ["train.micro_batch_size=2", "train.global_batch_size=2", "train.seq_length=512", "model.hidden_size=96"],
    ["train.micro_batch_size=8", "train.global_batch_size=8", "train.seq_length=128", "model.kda_chunk_size=32"],
    ["train.micro_batch_size=1", "train.global_batch_size=4", "train.seq_length=1024"],
    ["model=kimi_linear_tiny", "model.vocab_size=8192"],
    # bf16 weights with fp32 accumulation and Muon, 8 micro-batches of 64 tokens: the model states and DeepSpeed's
    # gradient buffers (its reduction bucket; under ZeRO-2 the partition buffer made again each backward) lead
    ["precision=bf16", "optim=muon", "train.micro_batch_size=1", "train.global_batch_size=8", "train.seq_length=64"],
    ["precision=bf16", "optim=muon", "train.micro_batch_size=1", "train.global_batch_size=8", "train.seq_length=64",
     "parallel.zero_stage=2"],
    # ZeRO-0 at 16 tokens: the step phase leads, with DeepSpeed's flat copy of every gradient for its all-reduce
    ["parallel.zero_stage=0", "train.micro_batch_size=1", "train.global_batch_size=2", "train.seq_length=16"],
    # ZeRO-1 at 16 tokens: its reduction after the last backward leads (the partition buffer beside the bucket)
    ["precision=bf16", "train.micro_batch_size=1", "train.global_batch_size=4", "train.seq_length=16"],
    # fp32 ZeRO-1 at 16 tokens: AdamW's step leads (a param group's flat fp32 gradient and AdamW's temporaries)
    ["train.micro_batch_size=1", "train.global_batch_size=4", "train.seq_length=16"],
    # ZeRO-0 with a 32k vocabulary: the gradient norm's float64 squares of the embedding's gradient lead
    ["parallel.zero_stage=0", "model.vocab_size=32768", "train.micro_batch_size=1", "train.global_batch_size=2",
     "train.seq_length=16"],
    # the embedding tied to the LM head: the head's gradient of it held through the backward, summed at its end
    ["model.tie_word_embeddings=true", "model.vocab_size=32768", "train.micro_batch_size=1",
     "train.global_batch_size=4", "train.seq_length=16"],
]


def memory_row(overrides):
    from megatron_k3.training.engine import shutdown
    from megatron_k3.training.loop import Trainer

    # optim=adamw unless a row names optim=muon (plan.py counts Muon's states as well)
    run, _, _ = compose_run_config(["logging.wandb.mode=disabled", "optim=adamw", *overrides])
    try:
        trainer = Trainer(run, Path(tempfile.mkdtemp()))  # a one-process DeepSpeed engine (ZeRO-1)
        tracker = LiveTensorMemory()
        tracker.track_all(list(trainer.model.parameters()) + list(trainer.model.buffers()) +
                          list(getattr(trainer.engine.optimizer, "single_partition_of_fp32_groups", [])))
        with tracker:
            for _ in range(2):
                trainer.train_step()
    finally:
        shutdown()
    plan = plan_training(run.model, run.cluster, Layout(world=1), workload(run, kernels="eager"))  # tools/plan.py's
    return run, tracker.peak, plan.memory_per_device


def flops_row(run):
    torch.manual_seed(0)
    model = K3ForCausalLM(run.model)
    B, T = 2, run.train.seq_length
    ids = torch.randint(0, run.model.vocab_size, (B, T))
    measured = count_flops(lambda: model(ids, labels=ids).loss.backward())
    return measured, model_flops(run.model, T, "dense").train_per_token * B * T


def main():
    torch.set_num_threads(1)
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread")
    print(f"{'config':<96} {'measured MB':>11} {'planner MB':>10} {'ratio':>6} | {'counted GFLOP':>13} "
          f"{'planner GFLOP':>13} {'ratio':>6}")
    for ov in CONFIGS:
        run, peak, est = memory_row(ov)
        fl, fl_est = flops_row(run)
        name = " ".join(ov) or "default (k3_tiny, 2 x 4 x 256 tokens, fp32, AdamW)"
        print(f"{name:<96} {peak / 1e6:11.1f} {est / 1e6:10.1f} {est / peak:6.3f} | {fl / 1e9:13.2f} "
              f"{fl_est / 1e9:13.2f} {fl_est / fl:6.3f}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
    print(f"process peak RSS over all rows: {rss:.0f} MB (Python, libraries, allocator caches included)")


if __name__ == "__main__":
    main()
