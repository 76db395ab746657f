"""Expert balance of k3_tiny under each router-bias rule (moe.balancing=quantile|sign|none): 64 experts, top-8,
static-shape dispatch with capacity factor 1.25, trained on the embedded corpus from the command line.

    .venv/bin/python bench/moe_balance.py [--steps 200] [--global-batch 16] [--out runs/moe_balance]

Prints, per rule, expert_load.max_over_mean (max over experts and MoE layers of the step's load / mean load)
and dropped_frac (assignments over capacity) at the last step and averaged over the last 20 steps, and the
loss; writes the table to <out>/balance.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["model.num_experts=64", "model.top_k=8", "model.moe_overflow=drop", "model.moe_capacity_factor=1.25"]


def run(rule: str, steps: int, gbs: int, out: Path) -> list:
    run_dir = out / rule
    if not (run_dir / "metrics.jsonl").is_file() or len((run_dir / "metrics.jsonl").read_text().splitlines()) < steps:
        args = [sys.executable, "-m", "megatron_k3.train", *MODEL, f"moe.balancing={rule}", f"train.steps={steps}",
                f"train.global_batch_size={gbs}", f"train.micro_batch_size={min(gbs, 8)}", "train.seq_length=256",
                "train.eval_interval=0", "optim=adamw", "logging.wandb.mode=disabled", f"hydra.run.dir={run_dir}"]
        subprocess.run(args, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "runs" / "moe_balance"))
    a = ap.parse_args()
    out = Path(a.out)
    lines = [f"k3_tiny, {' '.join(MODEL)}, {a.global_batch} x 256 tokens per step, {a.steps} steps", "",
             "| moe.balancing | max_over_mean (last step) | max_over_mean (mean of last 20) | cv (last 20) | "
             "dropped_frac (last step) | dropped_frac (mean of last 20) | dead experts (last) | loss (last 20) |",
             "|---|---|---|---|---|---|---|---|"]
    for rule in ("quantile", "sign", "none"):
        rows = run(rule, a.steps, a.global_batch, out)
        last, tail = rows[-1], rows[-20:]
        el = [r["expert_load"] for r in tail]
        lines.append(f"| {rule} | {last['expert_load']['max_over_mean']:.3f} | "
                     f"{sum(e['max_over_mean'] for e in el) / len(el):.3f} | {sum(e['cv'] for e in el) / len(el):.3f} | "
                     f"{100 * last['expert_load']['dropped_frac']:.2f}% | "
                     f"{100 * sum(e['dropped_frac'] for e in el) / len(el):.2f}% | {last['expert_load']['dead_experts']} | "
                     f"{sum(r['loss'] for r in tail) / len(tail):.3f} |")
        print(lines[-1], flush=True)
    (out / "balance.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
