#!/usr/bin/env python
"""The step-time cost of a checkpoint save, synchronous and async, ours against torch.distributed.checkpoint (the
engine torchtitan saves with) on the same state, in one process, interleaved.

  ours sync     CheckpointManager.save(blocking=True): every piece streamed into rank_00000.safetensors, fsynced,
                index merged, committed (meta.json, rename, `latest`)
  ours async    checkpoint.async_save: the stall is the snapshot to host memory; a thread writes and commits
  dcp sync      torch.distributed.checkpoint.save({"model": state_dict, "optim": optimizer state_dict})
  dcp async     torch.distributed.checkpoint.async_save of the same (its default thread executor and staging)

For each: the stall (what the step loop waits for), the first train step after it (the writer competes for the
cores), and for async the time until the files are complete. The model is k3_tiny widened so the checkpoint is
about 1 GB (fp32 masters + AdamW's two states); overrides after the options replace or add to it.

    .venv/bin/python bench/checkpoint.py [--reps 3] [--dir /tmp/k3_ckpt_bench] [overrides ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from megatron_k3.config import compose_run_config  # noqa: E402
from megatron_k3.training.engine import base_optimizer, shutdown  # noqa: E402
from megatron_k3.training.loop import Trainer  # noqa: E402

MODEL = ["model=k3_tiny", "model.hidden_size=512", "model.vocab_size=32768", "model.num_experts=32",
         "model.moe_intermediate_size=256", "model.moe_latent_size=256", "model.dense_intermediate_size=1024",
         "model.shared_intermediate_size=256", "model.num_layers=4", "model.attn_res_block_size=2"]
TRAIN = ["train.seq_length=64", "train.micro_batch_size=1", "train.global_batch_size=1", "train.eval_interval=0",
         "optim=adamw", "logging.wandb.mode=disabled", "parallel.zero_stage=0", "train.steps=1000"]


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def dcp_save(t, opt, path, asynchronous=False):
    """What a torch.distributed.checkpoint user does at a save: build the state dicts, then save them."""
    state = {"model": t.model.state_dict(), "optim": opt.state_dict()}
    return (dcp.async_save if asynchronous else dcp.save)(state, checkpoint_id=str(path))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/k3_ckpt_bench")
    a, overrides = ap.parse_known_args(argv)
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    run, _, _ = compose_run_config(MODEL + TRAIN + [f"checkpoint.dir={root}/ours", "checkpoint.keep_last=1"]
                                   + overrides, world_size=1)
    t = Trainer(run, root / "run")
    try:
        for _ in range(2):
            t.train_step()
        opt = base_optimizer(t.engine)
        nbytes = sum(p.numel() * 4 for p in t.model.parameters()) + sum(
            v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
        rows = {k: {"stall": [], "next_step": [], "until_written": []}
                for k in ("ours sync", "ours async", "dcp sync", "dcp async")}
        plain = []
        for rep in range(a.reps):
            plain.append(timed(t.train_step)[0])
            # ours, synchronous
            s, _ = timed(t.checkpoints.save, t.pos, blocking=True)
            rows["ours sync"]["stall"].append(s)
            rows["ours sync"]["next_step"].append(timed(t.train_step)[0])
            # ours, async
            s, _ = timed(t.checkpoints.save, t.pos, blocking=False)
            t0 = time.perf_counter()
            rows["ours async"]["stall"].append(s)
            rows["ours async"]["next_step"].append(timed(t.train_step)[0])
            t.checkpoints.wait()
            rows["ours async"]["until_written"].append(time.perf_counter() - t0)
            # torch.distributed.checkpoint, synchronous
            d = root / f"dcp_{rep}"
            s, _ = timed(dcp_save, t, opt, d)
            rows["dcp sync"]["stall"].append(s)
            rows["dcp sync"]["next_step"].append(timed(t.train_step)[0])
            shutil.rmtree(d)
            # torch.distributed.checkpoint, async
            s, fut = timed(dcp_save, t, opt, d, asynchronous=True)
            t0 = time.perf_counter()
            rows["dcp async"]["stall"].append(s)
            rows["dcp async"]["next_step"].append(timed(t.train_step)[0])
            fut.result()
            rows["dcp async"]["until_written"].append(time.perf_counter() - t0)
            shutil.rmtree(d)
        step = statistics.median(plain)
        out = {"checkpoint_mb": round(nbytes / 1e6, 1), "params": sum(p.numel() for p in t.model.parameters()),
               "plain_step_s": round(step, 3), "reps": a.reps, "results": {}}
        print(f"checkpoint {nbytes / 1e6:.0f} MB (fp32 masters + AdamW states), plain step {step:.3f} s, "
              f"{a.reps} reps, medians")
        print(f"{'':12s} {'stall s':>9s} {'next step s':>12s} {'written after s':>16s} {'stall / dcp':>12s}")
        for k, r in rows.items():
            med = {m: (statistics.median(v) if v else None) for m, v in r.items()}
            peer = statistics.median(rows["dcp " + k.split()[1]]["stall"])
            med["stall_vs_dcp"] = med["stall"] / peer
            out["results"][k] = {m: (round(v, 4) if v is not None else None) for m, v in med.items()}
            w = f"{med['until_written']:16.3f}" if med["until_written"] is not None else f"{'-':>16s}"
            print(f"{k:12s} {med['stall']:9.3f} {med['next_step']:12.3f} {w} {med['stall_vs_dcp']:12.2f}")
        print(json.dumps(out))
    finally:
        shutdown()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
