"""Learning-rate schedule: linear warmup, then cosine (or constant) decay to min_lr over train.steps."""

from __future__ import annotations

import math


def lr_at(step: int, total_steps: int, lr: float, min_lr: float, warmup: int, decay: str = "cosine") -> float:
    """LR for optimizer step `step` (1-based)."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if decay == "constant" or total_steps <= warmup:
        return lr
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
