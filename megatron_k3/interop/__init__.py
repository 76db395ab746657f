"""Checkpoint layouts of other stacks (Hugging Face Kimi Linear, Kimi K3): `load_hf(path)` and `save_hf(model, path,
layout=...)` are the entry points (interop.hf)."""

from .hf import load_hf, save_hf

__all__ = ["load_hf", "save_hf"]
