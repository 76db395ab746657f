"""The machine line every benchmark prints above its table: CPU model, cores, Python, torch (and its threads)."""

from __future__ import annotations

import os
import platform
import subprocess

import torch


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001 - description only
        pass
    return (f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads)")
