#!/usr/bin/env python
"""Loss curves of k3_tiny with precision=bf16 and precision=mx_qat: same seed, same data, same steps, one
process, run one after the other. Prints the losses every --every steps and the final ones; the last column
is the ratio mx_qat / bf16.

    .venv/bin/python bench/qat_curves.py [--steps 200] [--out /tmp/qat_curves] [extra hydra overrides ...]

It builds the run exactly as `python -m megatron_k3.train` does (Trainer from megatron_k3.training.loop) and
calls megatron_k3.precision.prepare_model_for_precision on the model itself when the loop has not.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))



def run_one(precision: str, steps: int, out: Path, extra: list) -> list:
    from omegaconf import OmegaConf

    from megatron_k3.config import compose_run_config
    from megatron_k3.precision import prepare_model_for_precision
    from megatron_k3.precision.qat import grouped_experts
    from megatron_k3.training.loop import Trainer

    run_dir = out / precision
    overrides = ["model=k3_tiny", "optim=adamw", f"precision={precision}", f"train.steps={steps}",
                 "logging.wandb.mode=disabled", f"hydra.run.dir={run_dir}",
                 f"checkpoint.dir={run_dir}/checkpoints"] + extra
    run, cfg, _ = compose_run_config(overrides)
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # a re-run trains afresh (checkpoint.load=auto resumes)
    trainer = Trainer(run, run_dir)
    hooked = any(m.qat is not None for _, m in grouped_experts(trainer.model))
    if precision == "mx_qat" and not hooked:  # the loop does not call the hook yet: call it here (no new params,
        prepare_model_for_precision(trainer.model, run.precision)  # so the optimizer built already stays valid)
    t0 = time.time()
    trainer.fit(OmegaConf.to_container(cfg, resolve=True))
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"{precision}: {steps} steps in {time.time() - t0:.0f} s (loop hook called by the loop: {hooked})",
          flush=True)
    return recs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--out", default="/tmp/qat_curves")
    args, extra = ap.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    curves = {p: run_one(p, args.steps, out, extra) for p in ("bf16", "mx_qat")}
    by_step = {p: {r["step"]: r for r in recs} for p, recs in curves.items()}
    print("\n| step | bf16 loss | mx_qat loss | ratio mx_qat / bf16 |\n|---|---|---|---|")
    steps = sorted(set(by_step["bf16"]) & set(by_step["mx_qat"]))
    for s in steps:
        if s % args.every == 0 or s == steps[-1] or s == 1:
            a, b = by_step["bf16"][s]["loss"], by_step["mx_qat"][s]["loss"]
            print(f"| {s} | {a:.4f} | {b:.4f} | {b / a:.4f} |")
    last = steps[-1]
    ev = {p: by_step[p][last].get("eval_loss") for p in curves}
    if all(v is not None for v in ev.values()):
        print(f"| eval @ {last} | {ev['bf16']:.4f} | {ev['mx_qat']:.4f} | {ev['mx_qat'] / ev['bf16']:.4f} |")
    tail = {p: sum(by_step[p][s]["loss"] for s in steps[-10:]) / len(steps[-10:]) for p in curves}
    print(f"| mean of last {len(steps[-10:])} | {tail['bf16']:.4f} | {tail['mx_qat']:.4f} | "
          f"{tail['mx_qat'] / tail['bf16']:.4f} |")
    tps = {p: sum(r["tokens_per_s"] for r in curves[p]) / len(curves[p]) for p in curves}
    print(f"| tokens/s (mean) | {tps['bf16']:.0f} | {tps['mx_qat']:.0f} | {tps['mx_qat'] / tps['bf16']:.3f} |")


if __name__ == "__main__":
    main()
