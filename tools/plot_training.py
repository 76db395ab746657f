#!/usr/bin/env python
"""PNG plots of a training run from its metrics.jsonl, without W&B.

    python tools/plot_training.py RUN_DIR_OR_METRICS_JSONL [--out DIR]

Writes into DIR (default: <run dir>/plots):
  loss.png         training loss per step with the evaluation loss, learning rate, gradient norm, and
                   throughput / MFU
  expert_load.png  expert load: the most loaded expert's load / mean per MoE layer over the steps
                   (heatmap, steps x layers), and load / mean per MoE layer and expert at the last step
                   that has per-expert counts (heatmap, layers x experts)
  attn_res.png     AttnRes depth weights at the last step: every depth mix (rows: each layer's pre-mixer
                   and pre-FFN mix, then the output mix) over its sources (columns: b_0 the embedding,
                   the completed blocks, the running partial sum); and the output mix's weights over steps
  router.png       router entropy per MoE layer over steps, and the selection bias's spread and drift
Prints the paths it wrote. Plots that have no data in the file (e.g. no MoE, no AttnRes) are skipped.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_k3.training.metrics import attn_res_matrix  # noqa: E402


def load(path: Path) -> list:
    f = path / "metrics.jsonl" if path.is_dir() else path
    rows = []
    for line in f.read_text().splitlines():
        line = line.strip()
        if line:
            rows.append(json.loads(line))
    if not rows:
        raise ValueError(f"{f}: no records")
    return rows


def _save(plt, fig, path: Path, title: str | None = None) -> Path:
    """Title, lay out, write at 100 dpi and close one figure; returns its path."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _layer_ticks(ax, layers: list):
    """Label heatmap rows with layer numbers, every k-th one when there are many (K3: 92 MoE layers)."""
    every = max(1, -(-len(layers) // 32))
    ax.set_yticks(range(0, len(layers), every), [str(x) for x in layers[::every]])


def plot_loss(rows: list, out: Path) -> Path:
    plt = _plt()
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    ax[0, 0].plot(steps, [r["loss"] for r in rows], label="train loss", lw=1.2)
    ev = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if ev:
        ax[0, 0].plot([s for s, _ in ev], [v for _, v in ev], "o-", label="eval loss", ms=4)
    ax[0, 0].set(title="loss", xlabel="step", ylabel="cross-entropy (nats)")
    ax[0, 0].legend()
    ax[0, 1].plot(steps, [r["lr"] for r in rows], color="tab:green")
    ax[0, 1].set(title="learning rate", xlabel="step")
    ax[1, 0].plot(steps, [r["grad_norm"] for r in rows], color="tab:red")
    ax[1, 0].set(title="gradient norm (before clipping)", xlabel="step")
    ax[1, 1].plot(steps, [r["tokens_per_s"] for r in rows], color="tab:purple", label="tokens/s")
    ax[1, 1].set(title="throughput", xlabel="step", ylabel="tokens/s")
    lines = ax[1, 1].get_lines()
    if any("mfu" in r for r in rows):
        tw = ax[1, 1].twinx()
        lines += tw.plot(steps, [100 * r.get("mfu", float("nan")) for r in rows], color="tab:orange", ls="--",
                         label="MFU (right axis, %)")
        tw.set_ylabel("MFU (%)")
    ax[1, 1].legend(lines, [x.get_label() for x in lines], fontsize=8, loc="lower right")  # one legend, both axes
    return _save(plt, fig, out / "loss.png", "training curves")


def plot_expert_load(rows: list, out: Path):
    import numpy as np

    per = [(r["step"], r["expert_load_per_layer"]) for r in rows if r.get("expert_load_per_layer")]
    if not per:
        return None
    plt = _plt()
    detail = [(r["step"], r["expert_load_per_expert"]) for r in rows if r.get("expert_load_per_expert")]
    fig, ax = plt.subplots(1, 2 if detail else 1, figsize=(13 if detail else 7, 5), squeeze=False)
    layers = per[-1][1].get("layers", list(range(len(per[-1][1]["max_over_mean"]))))
    hist = np.array([p["max_over_mean"] for _, p in per])  # [steps, layers]
    im = ax[0, 0].imshow(hist.T, aspect="auto", origin="lower", cmap="magma",
                         extent=[per[0][0] - 0.5, per[-1][0] + 0.5, -0.5, len(layers) - 0.5])
    ax[0, 0].set(title="most loaded expert per MoE layer over steps", xlabel="step", ylabel="MoE layer")
    _layer_ticks(ax[0, 0], layers)
    fig.colorbar(im, ax=ax[0, 0], label="max load / mean load")
    if detail:
        step, d = detail[-1]
        t = np.array(d["tokens"], dtype=np.float64)  # [layers, experts]
        ratio = t / np.maximum(t.mean(-1, keepdims=True), 1e-12)
        im2 = ax[0, 1].imshow(ratio, aspect="auto", origin="lower", cmap="coolwarm", vmin=0, vmax=2,
                              interpolation="nearest")
        ax[0, 1].set(title=f"load per expert at step {step}", xlabel="expert", ylabel="MoE layer")
        _layer_ticks(ax[0, 1], d["layers"])
        fig.colorbar(im2, ax=ax[0, 1], label="tokens / mean tokens (1 = balanced)")
    return _save(plt, fig, out / "expert_load.png", "expert load")


def plot_attn_res(rows: list, out: Path):
    import numpy as np

    recs = [r for r in rows if r.get("attn_res_weights")]
    if not recs:
        return None
    plt = _plt()
    last = recs[-1]
    m, labels = attn_res_matrix(last["attn_res_weights"])
    fig, ax = plt.subplots(1, 2, figsize=(13, min(10, max(4, 0.22 * len(labels) + 1.5))))
    im = ax[0].imshow(np.ma.masked_invalid(m), aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    every = max(1, -(-len(labels) // 48))  # at most ~48 row labels (K3 has 187 depth mixes)
    ax[0].set_yticks(range(0, len(labels), every), labels[::every], fontsize=7 if every == 1 else 6)
    ax[0].set_xticks(range(m.shape[1]), ["b0 (emb)"] + [f"b{j}" for j in range(1, m.shape[1])], fontsize=7)
    ax[0].set(title=f"depth weights at step {last['step']} (last column of a row = running partial)",
              xlabel="source block")
    fig.colorbar(im, ax=ax[0], label="softmax weight")
    outs = [(r["step"], r["attn_res_weights"]["output"]) for r in recs if r["attn_res_weights"].get("output")]
    if outs:
        width = max(len(w) for _, w in outs)
        for j in range(width):
            ax[1].plot([s for s, _ in outs], [w[j] if j < len(w) else np.nan for _, w in outs],
                       label="b0 (embedding)" if j == 0 else f"b{j}")
        ax[1].set(title="output mix weight per block over steps", xlabel="step", ylabel="weight")
        ax[1].legend(fontsize=7)
    return _save(plt, fig, out / "attn_res.png", "Block Attention Residuals")


def plot_router(rows: list, out: Path):
    import numpy as np

    recs = [r for r in rows if r.get("router_per_layer")]
    if not recs:
        return None
    plt = _plt()
    steps = [r["step"] for r in recs]
    fig, ax = plt.subplots(1, 2, figsize=(13, 5))
    if all("entropy" in r["router_per_layer"] for r in recs):
        e = np.array([r["router_per_layer"]["entropy"] for r in recs])
        layers = recs[-1]["router_per_layer"].get("layers", list(range(e.shape[1])))
        im = ax[0].imshow(e.T, aspect="auto", origin="lower", cmap="viridis",
                          extent=[steps[0] - 0.5, steps[-1] + 0.5, -0.5, e.shape[1] - 0.5])
        ax[0].set(title="router entropy per MoE layer (1 = uniform over experts)", xlabel="step",
                  ylabel="MoE layer")
        _layer_ticks(ax[0], layers)
        fig.colorbar(im, ax=ax[0], label="normalised entropy")
    std = np.array([r["router_per_layer"]["bias_std"] for r in recs])
    drift = [r.get("router", {}).get("bias_drift", np.nan) for r in recs]
    ax[1].plot(steps, std.mean(1), label="bias std (mean over layers)")
    ax[1].plot(steps, std.max(1), label="bias std (max over layers)")
    ax[1].plot(steps, drift, label="bias drift (RMS change per step)", ls="--")
    ax[1].set(title="router selection bias (Quantile Balancing)", xlabel="step")
    ax[1].legend(fontsize=8)
    return _save(plt, fig, out / "router.png")


def main(argv) -> int:
    args = [a for a in argv if not a.startswith("--")]
    if not args or "-h" in argv or "--help" in argv:
        print(__doc__.strip())
        return 0 if args or "-h" in argv or "--help" in argv else 2
    src = Path(args[0])
    out = None
    if "--out" in argv:
        i = argv.index("--out")
        if i + 1 >= len(argv):
            print("plot_training: --out needs a directory", file=sys.stderr)
            return 2
        out = Path(argv[i + 1])
        args = [a for a in args if a != argv[i + 1]]
    try:
        rows = load(src)
    except (OSError, ValueError) as e:
        print(f"plot_training: {e}", file=sys.stderr)
        return 2
    out = out or ((src if src.is_dir() else src.parent) / "plots")
    out.mkdir(parents=True, exist_ok=True)
    for fn in (plot_loss, plot_expert_load, plot_attn_res, plot_router):
        p = fn(rows, out)
        if p is not None:
            print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
