"""Metrics: `metrics.jsonl` (one JSON object per logged step, flushed per line) and W&B (offline by
default, inside the run directory), expert load included.

Expert load at full size is 896 experts x 92 MoE layers; W&B gets a bounded set of series: global
summaries, two per MoE layer (max/mean and CV), the most and least loaded experts, and the full
[layers x experts] load as an image and a histogram every `media_interval` steps.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def expert_load_stats(loads_LE: torch.Tensor, assignments_total: int | None = None, dropped: float = 0.0,
                      bias_LE: torch.Tensor | None = None) -> dict:
    """loads_LE: token-expert assignments the routers chose for each expert in each MoE layer over one step
    (before any capacity drop); dropped: assignments over capacity, not computed.

    max_over_mean: max over experts and layers of load / mean load; cv: coefficient of variation of the
    per-expert load, averaged over layers; dead_experts: experts with no token, summed over layers;
    dropped_frac: dropped / all assignments; bias_*: the routers' selection bias (per layer, and its spread)."""
    loads = loads_LE.double()
    mean = loads.mean(-1, keepdim=True).clamp_min(1e-12)
    ratio = loads / mean
    cv = loads.std(-1, unbiased=False) / mean.squeeze(-1)
    total = assignments_total or loads.sum().item()
    dead = (loads == 0).sum(-1)
    summary = {"max_over_mean": ratio.max().item(), "cv": cv.mean().item(),
               "dropped_frac": float(dropped) / total if total else 0.0, "dead_experts": int(dead.sum())}
    per_layer = {"max_over_mean": [round(v, 5) for v in ratio.max(-1).values.tolist()],
                 "min_over_mean": [round(v, 5) for v in ratio.min(-1).values.tolist()],
                 "cv": [round(v, 5) for v in cv.tolist()], "dead_experts": dead.tolist()}
    if bias_LE is not None and bias_LE.numel():
        b = bias_LE.double()
        summary.update(bias_std=b.std(-1, unbiased=False).mean().item(), bias_absmax=b.abs().max().item())
        per_layer.update(bias_std=[round(v, 6) for v in b.std(-1, unbiased=False).tolist()],
                         bias_min=[round(v, 6) for v in b.min(-1).values.tolist()],
                         bias_max=[round(v, 6) for v in b.max(-1).values.tolist()])
    return {"summary": summary, "per_layer": per_layer}


class MetricsLogger:
    """Rank-0 sink for per-step records: metrics.jsonl and an optional W&B run."""

    def __init__(self, run_dir: Path, wandb_cfg, run_config: dict, moe_layer_ids: list, enabled: bool = True):
        self.enabled = enabled
        self.moe_layer_ids = moe_layer_ids
        self.cfg = wandb_cfg
        self.file = open(run_dir / "metrics.jsonl", "a", buffering=1) if enabled else None
        self.wandb = None
        if enabled and wandb_cfg.mode != "disabled":
            import os

            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self.wandb = wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity or None,
                                    name=wandb_cfg.name or run_dir.name, dir=str(run_dir), mode=wandb_cfg.mode,
                                    config=run_config, resume="allow", id=_wandb_id(run_dir))
            self.wandb.define_metric("step")
            self.wandb.define_metric("*", step_metric="step")

    def log(self, record: dict, loads_LE: torch.Tensor | None = None):
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        if self.wandb is None:
            return
        step = record["step"]
        flat = {"step": step}
        for k in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "eval_loss", "eval_ppl"):
            if k in record:
                flat[f"train/{k}" if not k.startswith("eval") else f"eval/{k[5:]}"] = record[k]
        el = record.get("expert_load")
        if el:
            for k, v in el.items():
                flat[f"expert_load/{k}"] = v
            per = record.get("expert_load_per_layer", {})
            for j, layer in enumerate(self.moe_layer_ids):
                flat[f"expert_load_layer/{layer:03d}/max_over_mean"] = per["max_over_mean"][j]
                flat[f"expert_load_layer/{layer:03d}/cv"] = per["cv"][j]
                if "bias_std" in per:  # Quantile Balancing / sign: drift of the selection bias
                    flat[f"expert_load_layer/{layer:03d}/bias_std"] = per["bias_std"][j]
        if loads_LE is not None:
            total = loads_LE.double().sum(0)
            share = total / total.mean().clamp_min(1e-12)
            k = min(self.cfg.top_experts, share.numel())
            top, bot = share.topk(k), share.topk(k, largest=False)
            for i in range(k):
                flat[f"expert_load_top/{i + 1}/load_over_mean"] = top.values[i].item()
                flat[f"expert_load_top/{i + 1}/expert"] = int(top.indices[i])
                flat[f"expert_load_bottom/{i + 1}/load_over_mean"] = bot.values[i].item()
                flat[f"expert_load_bottom/{i + 1}/expert"] = int(bot.indices[i])
            if self.cfg.media_interval and (step == 1 or step % self.cfg.media_interval == 0):
                flat.update(self._media(loads_LE))
        self.wandb.log(flat)

    def _media(self, loads_LE: torch.Tensor) -> dict:
        import numpy as np
        import wandb

        ratio = (loads_LE.double() / loads_LE.double().mean(-1, keepdim=True).clamp_min(1e-12)).numpy()
        # heatmap: rows = MoE layers, columns = experts; 0 -> black, mean load -> mid grey, >=2x mean -> white
        img = np.clip(ratio / 2.0 * 255.0, 0, 255).astype(np.uint8)
        img = np.repeat(np.repeat(img, max(1, 64 // img.shape[0]), 0), max(1, 512 // img.shape[1]), 1)
        return {"expert_load/heatmap": wandb.Image(img, caption="MoE layer (rows) x expert (cols): load / mean"),
                "expert_load/histogram": wandb.Histogram(ratio.flatten())}

    def close(self):
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_id(run_dir: Path) -> str:
    """A stable run id per run directory, so a resumed run appends to the same W&B run."""
    f = run_dir / ".wandb_id"
    if f.is_file():
        return f.read_text().strip()
    import uuid

    rid = uuid.uuid4().hex[:12]
    f.write_text(rid)
    return rid


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
