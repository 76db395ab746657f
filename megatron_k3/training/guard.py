"""Training guards (`train.guard`, docs/checkpoints_and_faults.md "Guards"): loss and gradient-norm spikes judged
against a rolling window of the accepted steps, the step's update withheld or the run stopped, every decision
recorded; alarms on the experts' load and the routers' entropy; and the slowest ranks named (stragglers).

The spike test is robust: a value is a spike when it exceeds the window's median by more than `zscore` robust
spreads (1.4826 x the median absolute deviation, the standard deviation's estimate for normal data) and by more
than `min_relative` of the median, once the window holds `min_history` steps. The loss is the global batch's and
the gradient norm the global one (every rank computes the same numbers: the loss is reduced over the pipeline and
data-parallel groups in one small all-reduce at the step boundary, the norm is DeepSpeed's, reduced already), so
every rank takes the same decision without exchanging it. A non-finite loss or norm joins the same machinery
(reason `nonfinite`); it is skipped under every policy, as before the guards.

Peers: Megatron-LM's rerun state machine (`--check-for-spiky-loss`, `--check-for-large-grads`,
`--rerun-mode validate_results`), MaxText's `skip_step_on_spikes`, torchtitan's stop on a non-finite loss.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque

import torch

log = logging.getLogger("megatron_k3.train")

__all__ = ["SpikeGuard", "Alarms", "Stragglers", "POLICIES"]

POLICIES = ("none", "skip", "stop", "rerun", "rollback")
_MAD_TO_STD = 1.4826


def _spike(x: float, history, zscore: float, min_relative: float) -> tuple:
    """(is x a spike against `history`, its robust z-score)."""
    med = statistics.median(history)
    spread = _MAD_TO_STD * statistics.median(abs(v - med) for v in history)
    z = (x - med) / spread if spread > 0 else (math.inf if x > med else 0.0)
    return x > med + max(zscore * spread, min_relative * abs(med)), z


class SpikeGuard:
    """The decisions of `train.guard` (a GuardConfig): `judge` a step's loss and gradient norm before its update,
    `accept` the values of a step whose update was applied; `state` / `load` carry the window and the decisions
    through checkpoints, so a resumed run judges as the uninterrupted one would have."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.loss = deque(maxlen=cfg.window)
        self.grad = deque(maxlen=cfg.window)
        self.events: list = []  # every step the guard withheld or stopped: {"step", "reason", "loss", "grad_norm"}
        self.spent = 0  # policy=rollback: events before this index caused a rollback already

    @property
    def active(self) -> bool:
        return self.cfg.policy != "none"

    def judge(self, step: int, loss: float, grad_norm: float) -> tuple:
        """(reason or None, {"loss_z", "grad_z"}): `nonfinite`, `loss_spike`, `grad_spike` (the loss first)."""
        c = self.cfg
        z = {"loss_z": 0.0, "grad_z": 0.0}
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return "nonfinite", z
        if len(self.loss) < c.min_history:
            return None, z
        reason = None
        if c.loss_zscore > 0:
            hit, z["loss_z"] = _spike(loss, self.loss, c.loss_zscore, c.min_relative)
            reason = "loss_spike" if hit else None
        if c.grad_zscore > 0:
            hit, z["grad_z"] = _spike(grad_norm, self.grad, c.grad_zscore, c.min_relative)
            reason = reason or ("grad_spike" if hit else None)
        return reason, z

    def accept(self, loss: float, grad_norm: float) -> None:
        self.loss.append(float(loss))
        self.grad.append(float(grad_norm))

    def record(self, step: int, reason: str, loss: float, grad_norm: float, z: dict) -> dict:
        """Log and keep one withheld (or stopping) step; returns its record."""
        ev = {"step": step, "reason": reason, "action": "stop" if self.cfg.policy == "stop" else "skip",
              "loss": float(loss), "grad_norm": float(grad_norm),
              "loss_z": round(float(z["loss_z"]), 3), "grad_z": round(float(z["grad_z"]), 3)}
        self.events.append(ev)
        return ev

    def state(self) -> dict:
        return {"loss": list(self.loss), "grad": list(self.grad), "events": list(self.events),
                "spent": self.spent}

    def load(self, st: dict | None) -> None:
        if not st:
            return
        self.loss.clear()
        self.loss.extend(st.get("loss", []))
        self.grad.clear()
        self.grad.extend(st.get("grad", []))
        self.events = list(st.get("events", []))
        self.spent = st.get("spent", 0)


class Alarms:
    """`train.guard.alarm_load` / `alarm_entropy`: a MoE layer whose expert load max/mean stays above alarm_load,
    or whose router entropy stays below alarm_entropy, for alarm_steps steps in a row is named in a warning (once
    per episode); the metrics themselves are the step record's (expert_load_per_layer, router_per_layer)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.runs: dict = {}  # (kind, layer) -> consecutive steps past the threshold

    def check(self, step: int, rec: dict) -> list:
        """The alarms raised at this step: [(kind, layer, value)], each also logged on the caller's rank 0."""
        c, out = self.cfg, []
        load = rec.get("expert_load_per_layer") or {}
        router = rec.get("router_per_layer") or {}
        series = []
        if c.alarm_load > 0 and load:
            series.append(("expert_load_max_over_mean", load["layers"], load["max_over_mean"],
                           lambda v: v > c.alarm_load))
        if c.alarm_entropy > 0 and router.get("entropy"):
            series.append(("router_entropy", router["layers"], router["entropy"], lambda v: v < c.alarm_entropy))
        for kind, layers, values, bad in series:
            for layer, v in zip(layers, values):
                n = self.runs.get((kind, layer), 0) + 1 if bad(v) else 0
                self.runs[(kind, layer)] = n
                if n == c.alarm_steps:
                    out.append((kind, layer, v))
        return out


class Stragglers:
    """`train.guard.straggler_interval` (0: off): every that many steps the ranks exchange their compute time (step
    time minus the time spent in blocking collectives, training.faults.COLLECTIVE_SECONDS) and collective time over
    the interval, in one all-gather of two numbers; the slowest ranks by compute time are named with their node and
    their share of the step. The others' extra wait is the straggler's cost."""

    def __init__(self, cfg, rank: int, world: int, nodes: list):
        self.cfg, self.rank, self.world, self.nodes = cfg, rank, world, nodes
        self.step_s, self.wait_s, self.steps, self.wait0 = 0.0, 0.0, 0, None

    def add(self, step_seconds: float, wait_total: float) -> None:
        """One step of `step_seconds`; `wait_total`: the process's collective seconds so far."""
        self.wait0 = wait_total if self.wait0 is None else self.wait0
        self.step_s += step_seconds
        self.wait_s, self.steps = wait_total - self.wait0, self.steps + 1

    def due(self, step: int) -> bool:
        return bool(self.cfg.straggler_interval) and step % self.cfg.straggler_interval == 0 and self.world > 1

    def report(self, gather) -> list:
        """The slowest ranks (at most 3): [{"rank", "node", "compute_s", "wait_s", "share"}] per step over the
        interval; `gather(tensor [2]) -> [world, 2]` is the all-gather. Resets the interval."""
        n = max(self.steps, 1)
        mine = torch.tensor([(self.step_s - self.wait_s) / n, self.wait_s / n], dtype=torch.float64)
        rows = gather(mine)
        self.step_s, self.wait_s, self.steps, self.wait0 = 0.0, 0.0, 0, None
        step = float(rows.sum(1).max())
        order = sorted(range(self.world), key=lambda r: -float(rows[r, 0]))
        return [{"rank": r, "node": self.nodes[r], "compute_s": round(float(rows[r, 0]), 4),
                 "wait_s": round(float(rows[r, 1]), 4), "share": round(float(rows[r, 0]) / step, 4) if step else 0.0}
                for r in order[:3]]
