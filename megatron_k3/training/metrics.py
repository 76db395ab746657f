"""Metrics: `metrics.jsonl` (one JSON object per logged step, flushed per line) and W&B (offline by
default, inside the run directory): loss, learning rate, gradient norm, throughput, model FLOPs and MFU,
memory, expert load, router entropy and selection-bias drift, AttnRes depth weights.

At full size there are 896 experts x 92 MoE layers and 187 depth mixes; W&B gets a bounded set of series
(`wandb_scalars`): global summaries, two per MoE layer (expert load max/mean and CV), the most and least
loaded experts, the output mix's weight per AttnRes block, and every `media_interval` steps images and a
table for the per-layer detail (expert load [layers x experts] and its history, depth weights [sub-layers
x blocks], router entropy and bias statistics per layer). metrics.jsonl holds the per-layer detail every
logged step and the per-expert token counts every `media_interval` steps (`expert_load_per_expert`).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist

from ..model.decoder import DepthMix
from ..planning.flops import media_flops, model_flops

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
    # assignments_total is per MoE layer; dropped is summed over the layers
    total = (assignments_total * loads.shape[0]) if assignments_total else loads.sum().item()
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


def train_flops_per_token(model_cfg, seq_length: int) -> float:
    """Model FLOPs of one training token (forward + backward, causal attention, no recomputation). The vision tower's
    are not in it: they depend on the media a step actually holds (`media_train_flops`)."""
    return model_flops(model_cfg, seq_length, "causal", image_share=0.0).train_per_token


def media_train_flops(model_cfg, grid_thws) -> float:
    """Model FLOPs the vision tower and projector spend on a batch's media (forward + backward; forward only with
    model.freeze_vision), grid_thws [M, 3] or None."""
    if grid_thws is None or not len(grid_thws):
        return 0.0
    return float(sum(media_flops(model_cfg, [tuple(int(v) for v in g) for g in grid_thws])))


def throughput(flops_per_token: float, tokens: int, seconds: float, peak_tflops: float, world: int,
               extra_flops: float = 0.0) -> dict:
    """Model FLOPs of the step, achieved model TFLOP/s per device, and MFU against the cluster's peak."""
    flops = flops_per_token * tokens + extra_flops  # extra: the vision tower's, on the step's media
    per_device = flops / max(seconds, 1e-9) / max(world, 1)
    return {"model_flops_per_step": flops, "model_tflops_per_s_per_device": per_device / 1e12,
            "mfu": per_device / (peak_tflops * 1e12) if peak_tflops > 0 else 0.0}


def memory_stats(device: torch.device) -> dict:
    """Peak memory of this process: CUDA's allocator high-water mark on GPU, the peak resident set on CPU."""
    if device.type == "cuda":
        return {"kind": "cuda_max_allocated", "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9,
                "reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9}
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"kind": "cpu_peak_rss", "peak_gb": rss * (1 if sys.platform == "darwin" else 1024) / 1e9}


class RoutingStats:
    """Per-step routing counts of this rank's MoE layers, in the rows of the model's MoE layers (all stages')."""

    def __init__(self, model):
        cfg = model.cfg
        self.moe = model.moe_layers()
        self.layer_ids = [i for i, ty in enumerate(cfg.ffn_types()) if ty == "moe"]
        self.rows = [self.layer_ids.index(layer.layer_idx) for layer in model.model.layers if layer.ffn_type == "moe"]
        self.num_experts = cfg.num_experts
        # balanced dispatch (model.moe_overflow=balanced under expert parallelism): its per-forward plan statistics
        self.balanced = [d.balanced for d in (m.dispatcher for m in self.moe) if getattr(d, "balanced", None)]

    def ep_balance(self) -> torch.Tensor:
        """[2] of the last forward, over this rank's MoE layers (zeros without balanced dispatch): the largest ratio
        of the pairs one EP rank computed to the mean over its EP group (1 when the plan balanced exactly), and the
        most replica slots in use in one layer's EP group."""
        out = torch.zeros(2, dtype=torch.float64)
        for b in self.balanced:
            if b.stats is not None:
                load_R, replicas = b.stats
                load_R = load_R.double().cpu()
                out[0] = max(out[0], load_R.max() / load_R.mean().clamp_min(1e-12))
                out[1] = max(out[1], float(replicas))
        return out

    def add(self, loads_LE: torch.Tensor) -> torch.Tensor:
        """Add the last forward's token counts to their rows of loads_LE; returns the dropped assignments."""
        dropped = torch.zeros((), dtype=torch.float64)
        for row, m in zip(self.rows, self.moe):
            loads_LE[row] += m.tokens_per_expert_E.double().cpu()
            dropped += m.dropped_assignments.double().cpu()
        return dropped

    def bias(self, pp_group=None, device=None) -> torch.Tensor:
        """[MoE layers, experts]: every router's selection bias (summed over the pipeline stages, which each fill
        their own rows)."""
        bias_LE = torch.zeros(len(self.layer_ids), self.num_experts)
        for row, m in zip(self.rows, self.moe):
            bias_LE[row] = m.gate.e_score_correction_bias.detach().float().cpu()
        if pp_group is not None and dist.get_world_size(pp_group) > 1:
            bias_LE = bias_LE.to(device)
            dist.all_reduce(bias_LE, group=pp_group)
            bias_LE = bias_LE.cpu()
        return bias_LE


class ModelStats:
    """Per-step statistics read off the model: router entropy per MoE layer and AttnRes depth weights per mix
    (averaged over the step's micro-batches; `accumulate` after each), and the routers' selection-bias
    statistics with their drift since the previous `collect` (the RMS change of the bias, i.e. how far
    Quantile Balancing moved it). Values stay on the device until `collect`."""

    def __init__(self, model):
        self.routers = [m.gate for m in model.moe_layers()]
        numbered = [(layer.layer_idx, layer) for layer in model.model.layers]
        self.moe_layer_ids = [i for i, layer in numbered if getattr(layer, "ffn_type", None) == "moe"]
        self.mixes = []  # (layer index or -1 for the output mix, "pre_mixer" | "pre_ffn" | "output", module)
        for i, layer in numbered:
            for what, name in (("pre_mixer", "self_attention_res"), ("pre_ffn", "mlp_res")):
                m = getattr(layer, name, None)
                if isinstance(m, DepthMix):
                    self.mixes.append((i, what, m))
        out = getattr(model.model, "output_attn_res", None)
        if isinstance(out, DepthMix):
            self.mixes.append((-1, "output", out))
        self._entropy, self._weights, self._n = None, {}, 0
        self._prev_bias = None

    def accumulate(self):
        ents = [r.last_entropy for r in self.routers if r.last_entropy is not None]
        if ents:
            e = torch.stack([x.float() for x in ents])
            self._entropy = e if self._entropy is None else self._entropy + e
        for j, (_, _, m) in enumerate(self.mixes):
            if m.last_weights_N is not None:
                w = m.last_weights_N.float()
                self._weights[j] = w if j not in self._weights else self._weights[j] + w
        self._n += 1

    def collect(self) -> dict:
        out = {}
        n = max(self._n, 1)
        if self.routers:
            bias = torch.stack([r.e_score_correction_bias.detach().float() for r in self.routers]).cpu()
            drift = ((bias - self._prev_bias).pow(2).mean(-1).sqrt() if self._prev_bias is not None
                     else torch.zeros(bias.shape[0]))
            self._prev_bias = bias.clone()
            per = {"layers": self.moe_layer_ids, "bias_mean": bias.mean(-1), "bias_std": bias.std(-1, unbiased=False),
                   "bias_min": bias.min(-1).values, "bias_max": bias.max(-1).values, "bias_drift": drift}
            if self._entropy is not None:
                per["entropy"] = self._entropy.cpu() / n
            out["router_per_layer"] = {k: (v if k == "layers" else [round(float(x), 6) for x in v])
                                       for k, v in per.items()}
            out["router"] = {"bias_absmax": float(bias.abs().max()),
                             "bias_std": float(bias.std(-1, unbiased=False).mean()),
                             "bias_drift": float(drift.pow(2).mean().sqrt())}
            if self._entropy is not None:
                e = self._entropy.cpu() / n
                out["router"].update(entropy_mean=float(e.mean()), entropy_min=float(e.min()))
        if self._weights:
            ar = {"layers": [], "pre_mixer": [], "pre_ffn": [], "output": None}
            rows = {}
            for j, (layer, what, _) in enumerate(self.mixes):
                if j in self._weights:
                    w = [round(float(x), 6) for x in (self._weights[j].cpu() / n)]
                    if what == "output":
                        ar["output"] = w
                    else:
                        rows.setdefault(layer, {})[what] = w
            for layer in sorted(rows):
                ar["layers"].append(layer)
                ar["pre_mixer"].append(rows[layer].get("pre_mixer"))
                ar["pre_ffn"].append(rows[layer].get("pre_ffn"))
            out["attn_res_weights"] = ar
            flat = [w for w in ar["pre_mixer"] + ar["pre_ffn"] if w]
            out["attn_res"] = {"embedding_weight": sum(w[0] for w in flat) / len(flat) if flat else 0.0,
                               "partial_weight": sum(w[-1] for w in flat) / len(flat) if flat else 0.0}
        self._entropy, self._weights, self._n = None, {}, 0
        return out


def attn_res_matrix(ar: dict):
    """[sub-layers x sources] depth weights from a record's `attn_res_weights`, NaN where a mix has fewer
    sources (source j = block j: b_0 the embedding, ..., the last being the running partial sum). Rows: the
    pre-mixer and pre-FFN mix of every layer in order, then the output mix. Returns (matrix, row labels)."""
    import numpy as np

    rows, labels = [], []
    for layer, a, f in zip(ar["layers"], ar["pre_mixer"], ar["pre_ffn"]):
        for what, w in (("mixer", a), ("ffn", f)):
            if w:
                rows.append(w)
                labels.append(f"L{layer} {what}")
    if ar.get("output"):
        rows.append(ar["output"])
        labels.append("output")
    width = max((len(r) for r in rows), default=0)
    m = np.full((len(rows), width), np.nan)
    for i, r in enumerate(rows):
        m[i, :len(r)] = r
    return m, labels


def wandb_scalars(record: dict, loads_LE: torch.Tensor | None, moe_layer_ids: list, top_experts: int) -> dict:
    """The scalar W&B series of one record: bounded at full size (no per-expert or per-mix series)."""
    flat = {"step": record["step"]}
    for k in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "mfu",
              "model_tflops_per_s_per_device", "model_flops_per_step"):
        if k in record:
            flat[f"train/{k}"] = record[k]
    for k in ("eval_loss", "eval_ppl"):
        if k in record:
            flat[f"eval/{k[5:]}"] = record[k]
    if "memory" in record:
        flat["memory/peak_gb"] = record["memory"]["peak_gb"]
    el = record.get("expert_load")
    if el:
        for k, v in el.items():
            flat[f"expert_load/{k}"] = v
        per = record.get("expert_load_per_layer", {})
        for j, layer in enumerate(moe_layer_ids):
            flat[f"expert_load_layer/{layer:03d}/max_over_mean"] = per["max_over_mean"][j]
            flat[f"expert_load_layer/{layer:03d}/cv"] = per["cv"][j]
    for group in ("router", "attn_res"):
        for k, v in record.get(group, {}).items():
            flat[f"{group}/{k}"] = v
    flat.update(_guard_scalars(record))
    out_w = (record.get("attn_res_weights") or {}).get("output")
    for j, v in enumerate(out_w or []):  # one per AttnRes block (9 at full size)
        flat[f"attn_res_output/block_{j:02d}"] = v
    if loads_LE is not None:
        total = loads_LE.double().sum(0)
        share = total / total.mean().clamp_min(1e-12)
        k = min(top_experts, share.numel())
        top, bot = share.topk(k), share.topk(k, largest=False)
        for i in range(k):
            flat[f"expert_load_top/{i + 1}/load_over_mean"] = top.values[i].item()
            flat[f"expert_load_top/{i + 1}/expert"] = int(top.indices[i])
            flat[f"expert_load_bottom/{i + 1}/load_over_mean"] = bot.values[i].item()
            flat[f"expert_load_bottom/{i + 1}/expert"] = int(bot.indices[i])
    return flat


def _guard_scalars(record: dict) -> dict:
    """train.guard's series (training/guard.py): skipped steps, a withheld step's reason as a flag and its z-scores,
    the alarms raised, the slowest rank of a straggler report."""
    flat = {"train/skipped": record.get("skipped", 0)}
    reason = record.get("guard")
    if reason is not None:
        flat[f"guard/{reason}"] = 1
        for k in ("guard_loss_z", "guard_grad_z", "guard_withheld_total"):
            if k in record:
                flat[f"guard/{k[6:]}"] = record[k]
    if record.get("alarms"):
        flat["guard/alarms"] = len(record["alarms"])
    slow = record.get("stragglers")
    if slow:
        flat.update({"stragglers/slowest_rank": slow[0]["rank"], "stragglers/slowest_share": slow[0]["share"],
                     "stragglers/slowest_compute_s": slow[0]["compute_s"], "stragglers/fastest_wait_s":
                     slow[-1]["wait_s"]})
    return flat


def _upscale(img, rows: int = 64, cols: int = 512):
    import numpy as np

    return np.repeat(np.repeat(img, max(1, rows // max(img.shape[0], 1)), 0), max(1, cols // max(img.shape[1], 1)), 1)


class MetricsLogger:
    """Rank-0 sink for per-step records: metrics.jsonl and an optional W&B run."""

    def __init__(self, run_dir: Path, wandb_cfg, run_config: dict, moe_layer_ids: list, enabled: bool = True):
        self.enabled = enabled
        self.moe_layer_ids = moe_layer_ids
        self.cfg = wandb_cfg
        self.file = open(run_dir / "metrics.jsonl", "a", buffering=1) if enabled else None
        self._history = []
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

    def _media_step(self, step: int) -> bool:
        return bool(self.cfg.media_interval) and (step == 1 or step % self.cfg.media_interval == 0)

    def log(self, record: dict, loads_LE: torch.Tensor | None = None):
        if not self.enabled:
            return
        step = record["step"]
        if loads_LE is not None and self._media_step(step):  # per-expert token counts, on the media cadence
            record = dict(record, expert_load_per_expert={
                "layers": self.moe_layer_ids, "tokens": [[int(round(x)) for x in row] for row in loads_LE.tolist()]})
        per = record.get("expert_load_per_layer")
        if per:  # a bounded history of per-layer imbalance for the "over time" heatmap
            self._history.append(per["max_over_mean"])
            del self._history[:-512]
        self.file.write(json.dumps(record) + "\n")
        if self.wandb is None:
            return
        flat = wandb_scalars(record, loads_LE, self.moe_layer_ids, self.cfg.top_experts)
        if self._media_step(step):
            flat.update(self._media(record, loads_LE))
        self.wandb.log(flat)

    def _media(self, record: dict, loads_LE: torch.Tensor | None) -> dict:
        import numpy as np
        import wandb

        out = {}
        if loads_LE is not None:
            ratio = (loads_LE.double() / loads_LE.double().mean(-1, keepdim=True).clamp_min(1e-12)).numpy()
            # heatmap: rows = MoE layers, columns = experts; 0 -> black, mean load -> mid grey, >=2x mean -> white
            img = np.clip(ratio / 2.0 * 255.0, 0, 255).astype(np.uint8)
            out["expert_load/heatmap"] = wandb.Image(_upscale(img), caption="MoE layer (rows) x expert (cols): "
                                                                             "load / mean, white = 2x mean")
            out["expert_load/histogram"] = wandb.Histogram(ratio.flatten())
        if self._history:
            h = np.asarray(self._history, dtype=np.float64)  # [logged steps, MoE layers]: max load / mean
            img = np.clip((h - 1.0) / 3.0 * 255.0, 0, 255).astype(np.uint8).T
            out["expert_load/max_over_mean_history"] = wandb.Image(
                _upscale(img), caption="MoE layer (rows) x logged step (cols): max load / mean, black = 1, white >= 4")
        ar = record.get("attn_res_weights")
        if ar:
            m, _ = attn_res_matrix(ar)
            img = np.nan_to_num(np.clip(m * 255.0, 0, 255), nan=0).astype(np.uint8)
            out["attn_res/depth_weights"] = wandb.Image(
                _upscale(img, 256, 256), caption="depth mix (rows: L0 mixer, L0 ffn, ..., output) x source "
                                                 "(cols: b_0 = embedding, blocks, partial): weight, white = 1")
        rp = record.get("router_per_layer")
        if rp:
            cols = [k for k in ("entropy", "bias_mean", "bias_std", "bias_min", "bias_max", "bias_drift") if k in rp]
            out["router/per_layer"] = wandb.Table(columns=["layer"] + cols,
                                                  data=[[layer] + [rp[c][j] for c in cols]
                                                        for j, layer in enumerate(rp["layers"])])
        return out

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
