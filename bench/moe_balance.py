"""Expert balance of k3_tiny under each router-bias rule (moe.balancing=quantile|sign|none): 64 experts, top-8,
static-shape dispatch with capacity factor 1.25, trained on the embedded corpus from the command line.

    .venv/bin/python bench/moe_balance.py [--steps 200] [--global-batch 16] [--out runs/moe_balance]

Trains each rule with the default optimizer (Per-Head Muon + AdamW), and Quantile Balancing also with
optim=adamw. Prints, per run, expert_load.max_over_mean (max over experts and MoE layers of the step's load /
mean load) and dropped_frac (assignments over capacity) at the last step and averaged over the last 20 steps,
and the loss.

Then the batch-size floor: the Quantile Balancing run's last checkpoint is loaded, its weights frozen, and the
router inputs of 512 unseen sequences captured. For n sequences per step, the bias is estimated (one QB update,
exactly as the trainer does it) on n sequences and applied to the next n ones: that is the balance any rule
which sets the bias before it sees the batch can reach with these weights, with no parameter drift at all.
The same bias applied to the batch it was estimated on shows QB's own error. Writes <out>/balance.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODEL = ["model.num_experts=64", "model.top_k=8", "model.moe_overflow=drop", "model.moe_capacity_factor=1.25"]
RUNS = (("quantile", "quantile", []), ("quantile, optim=adamw", "quantile_adamw", ["optim=adamw"]),
        ("sign (rate 1e-3)", "sign", []), ("none", "none", []))


def overrides(rule: str, steps: int, gbs: int, run_dir: Path, extra: list) -> list:
    return [*MODEL, f"moe.balancing={rule}", f"train.steps={steps}", f"train.global_batch_size={gbs}",
            f"train.micro_batch_size={min(gbs, 8)}", "train.seq_length=256", "train.eval_interval=0",
            f"train.save_interval={steps}", "logging.wandb.mode=disabled", f"hydra.run.dir={run_dir}",
            f"checkpoint.dir={run_dir / 'checkpoints'}", *extra]


def run(rule: str, name: str, steps: int, gbs: int, out: Path, extra: list) -> list:
    run_dir = out / name
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file() or len(metrics.read_text().splitlines()) < steps:
        args = [sys.executable, "-m", "megatron_k3.train", *overrides(rule, steps, gbs, run_dir, extra)]
        subprocess.run(args, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def floor(run_dir: Path, steps: int, gbs: int, sizes=(16, 32, 64, 128, 256), pool: int = 512) -> list:
    """Rows (n, out-of-sample max_over_mean [mean over batch pairs of the max over layers, and of the mean over
    layers], dropped at cf 1.25, in-sample max_over_mean) for the frozen QB run at its last step."""
    import torch

    from megatron_k3.config import MoEConfig, compose_run_config
    from megatron_k3.model.dispatcher import capacity
    from megatron_k3.training.balancing import BiasBalancer
    from megatron_k3.training.loop import Trainer

    run, _, _ = compose_run_config(overrides("quantile", steps, gbs, run_dir, ["checkpoint.load=auto"]),
                                   world_size=1)
    tr = Trainer(run, run_dir / "floor")
    tr.maybe_resume()
    assert tr.step == steps, f"expected the step-{steps} checkpoint in {run_dir}, resumed at {tr.step}"
    k, E, T = run.model.top_k, run.model.num_experts, run.train.seq_length
    xs = [[] for _ in tr.moe]
    hooks = [m.gate.register_forward_hook(lambda mod, inp, o, i=i: xs[i].append(inp[0].detach().float()))
             for i, m in enumerate(tr.moe)]
    tr.model.eval()
    with torch.no_grad():
        for c in range(0, pool, 8):
            tr._forward([tr.train_ds.sample(tr.consumed + c + j) for j in range(8)])
    for h in hooks:
        h.remove()
    scores = [torch.sigmoid(torch.cat(x) @ m.gate.weight.detach().float().T).view(pool, T, E)
              for x, m in zip(xs, tr.moe)]
    biases = [m.gate.e_score_correction_bias.detach().float() for m in tr.moe]

    def qb(s, b):  # one Quantile Balancing update with the trainer's own balancer (exact estimator)
        layer = SimpleNamespace(num_experts=E, top_k=k, gate=SimpleNamespace(e_score_correction_bias=b.clone()))
        balancer = BiasBalancer(layer, MoEConfig(quantile_estimator="exact"))
        balancer.observe(s, b)
        balancer.step()
        return layer.gate.e_score_correction_bias

    def load(s, b):
        return torch.bincount((s + b).topk(k, dim=-1).indices.reshape(-1), minlength=E).double()

    rows = []
    for n in sizes:
        cap = capacity(n * T, k, E, 1.25)
        out_max, out_mean, drop, in_max = [], [], [], []
        for a in range(0, pool - 2 * n + 1, 2 * n):
            per_out, per_in, dropped = [], [], 0.0
            for s_PTE, b in zip(scores, biases):
                sA, sB = s_PTE[a:a + n].reshape(-1, E), s_PTE[a + n:a + 2 * n].reshape(-1, E)
                lB = load(sB, qb(sA, b))
                per_out.append(float(lB.max() / lB.mean()))
                dropped += float((lB - cap).clamp_min(0).sum() / lB.sum())
                lA = load(sA, qb(sA, b))
                per_in.append(float(lA.max() / lA.mean()))
            out_max.append(max(per_out))
            out_mean.append(sum(per_out) / len(per_out))
            drop.append(dropped / len(scores))
            in_max.append(max(per_in))
        rows.append((n, *(sum(v) / len(v) for v in (out_max, out_mean, drop, in_max)), len(out_max)))
    return rows


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
    for label, name, extra in RUNS:
        rule = name.split("_")[0]
        rows = run(rule, name, a.steps, a.global_batch, out, extra)
        last, tail = rows[-1], rows[-20:]
        el = [r["expert_load"] for r in tail]
        lines.append(f"| {label} | {last['expert_load']['max_over_mean']:.3f} | "
                     f"{sum(e['max_over_mean'] for e in el) / len(el):.3f} | "
                     f"{sum(e['cv'] for e in el) / len(el):.3f} | "
                     f"{100 * last['expert_load']['dropped_frac']:.2f}% | "
                     f"{100 * sum(e['dropped_frac'] for e in el) / len(el):.2f}% | "
                     f"{last['expert_load']['dead_experts']} | "
                     f"{sum(r['loss'] for r in tail) / len(tail):.3f} |")
        print(lines[-1], flush=True)
    lines += ["", f"Batch-size floor: the quantile run frozen at step {a.steps}; bias from n sequences "
              "(one QB update), applied to the next n (mean over the disjoint pairs of 512 unseen sequences)", "",
              "| sequences per step | tokens | max_over_mean, next batch (max over layers) | same, mean over layers | "
              "dropped at cf 1.25 (one forward) | max_over_mean, same batch | pairs |", "|---|---|---|---|---|---|---|"]
    for n, o_max, o_mean, drop, i_max, pairs in floor(out / "quantile", a.steps, a.global_batch):
        lines.append(f"| {n} | {n * 256} | {o_max:.3f} | {o_mean:.3f} | {100 * drop:.2f}% | {i_max:.3f} | {pairs} |")
        print(lines[-1], flush=True)
    (out / "balance.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
