#!/usr/bin/env python
"""Loss curves of k3_tiny with optim=muon and optim=adamw: same seed, same data, same steps, one process, run
one after the other, each at its own learning rate. Prints the losses every --every steps, the final eval
losses and the optimizer's share of step time; the last column is the ratio muon / adamw. Writes the curves
as a PNG (--png) and the run directories and raw records (curves.json) under --out.

    .venv/bin/python bench/optim_curves.py [--steps 300] [--muon-lr 3e-3] [--adamw-lr 3e-3] \
        [--out /tmp/optim_curves] [--png bench/optim_curves.png] [extra hydra overrides ...]

It builds each run exactly as `python -m megatron_k3.train` does (Trainer from megatron_k3.training.loop).
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

import torch  # noqa: E402


def run_one(optim: str, lr: float, steps: int, out: Path, extra: list) -> dict:
    from omegaconf import OmegaConf

    from megatron_k3.config import compose_run_config
    from megatron_k3.training.loop import Trainer

    run_dir = out / f"{optim}_lr{lr:g}"
    overrides = ["model=k3_tiny", f"optim={optim}", f"optim.lr={lr}", f"optim.min_lr={lr / 10}",
                 f"train.steps={steps}", "train.save_interval=0", "parallel.zero_stage=0",
                 "logging.wandb.mode=disabled",
                 f"hydra.run.dir={run_dir}", f"checkpoint.dir={run_dir}/checkpoints"] + extra
    run, cfg, _ = compose_run_config(overrides)
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # a re-run trains afresh (checkpoint.load=auto resumes)
    trainer = Trainer(run, run_dir)
    opt_time = [0.0]
    opt = trainer.engine.optimizer  # ZeRO-0: the client optimizer itself
    step = opt.step

    def timed_step(*args, **kwargs):  # the optimizer's share of each step's wall time
        t = time.perf_counter()
        out = step(*args, **kwargs)
        opt_time[0] += time.perf_counter() - t
        return out

    opt.step = timed_step
    t0 = time.time()
    try:
        trainer.fit(OmegaConf.to_container(cfg, resolve=True))
    finally:
        from megatron_k3.training.engine import shutdown

        shutdown()
    wall = time.time() - t0
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"{optim} lr={lr:g}: {steps} steps in {wall:.0f} s, optimizer.step {opt_time[0]:.1f} s", flush=True)
    return {"optim": optim, "lr": lr, "records": recs, "wall_s": wall, "optimizer_s": opt_time[0]}


def plot(curves: dict, path: Path, smooth: int = 10):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, c in curves.items():
        steps = [r["step"] for r in c["records"]]
        loss = torch.tensor([r["loss"] for r in c["records"]])
        avg = torch.nn.functional.avg_pool1d(loss[None, None], smooth, 1, padding=smooth // 2,
                                             count_include_pad=False)[0, 0, : len(steps)]
        line, = ax.plot(steps, loss.tolist(), alpha=0.25, lw=0.8)
        ax.plot(steps, avg.tolist(), color=line.get_color(), lw=1.6, label=f"{name} (lr {c['lr']:g})")
        ev = [(r["step"], r["eval_loss"]) for r in c["records"] if "eval_loss" in r]
        ax.plot([s for s, _ in ev], [v for _, v in ev], "o", color=line.get_color(), ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (dots: eval loss)")
    ax.set_title("k3_tiny on the embedded corpus: optim=muon vs optim=adamw")
    ax.set_ylim(top=min(ax.get_ylim()[1], 8.0))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--muon-lr", type=float, default=3e-3)
    ap.add_argument("--adamw-lr", type=float, default=3e-3)
    ap.add_argument("--out", default="/tmp/optim_curves")
    ap.add_argument("--png", default=str(Path(__file__).resolve().parent / "optim_curves.png"))
    args, extra = ap.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    curves = {"muon": run_one("muon", args.muon_lr, args.steps, out, extra),
              "adamw": run_one("adamw", args.adamw_lr, args.steps, out, extra)}
    (out / "curves.json").write_text(json.dumps(curves))
    plot(curves, Path(args.png))
    by_step = {k: {r["step"]: r for r in c["records"]} for k, c in curves.items()}
    steps = sorted(set(by_step["muon"]) & set(by_step["adamw"]))
    print(f"\n| step | muon loss (lr {args.muon_lr:g}) | adamw loss (lr {args.adamw_lr:g}) | ratio muon / adamw |\n"
          "|---|---|---|---|")
    for s in steps:
        if s % args.every == 0 or s == 1:
            a, m = by_step["adamw"][s]["loss"], by_step["muon"][s]["loss"]
            print(f"| {s} | {m:.4f} | {a:.4f} | {m / a:.4f} |")
    for s in steps:
        if "eval_loss" in by_step["muon"][s] and "eval_loss" in by_step["adamw"][s]:
            a, m = by_step["adamw"][s]["eval_loss"], by_step["muon"][s]["eval_loss"]
            print(f"| eval @ {s} | {m:.4f} | {a:.4f} | {m / a:.4f} |")
    tail = {k: sum(by_step[k][s]["loss"] for s in steps[-20:]) / len(steps[-20:]) for k in curves}
    print(f"| mean of last {len(steps[-20:])} | {tail['muon']:.4f} | {tail['adamw']:.4f} | "
          f"{tail['muon'] / tail['adamw']:.4f} |")
    per = {k: c["optimizer_s"] / len(c["records"]) * 1e3 for k, c in curves.items()}
    print(f"| optimizer.step (ms/step) | {per['muon']:.1f} | {per['adamw']:.1f} | {per['muon'] / per['adamw']:.2f} |")
    print(f"\nplot: {args.png}")


if __name__ == "__main__":
    main()
