"""Checkpoint layouts of other stacks (Hugging Face Kimi Linear, Kimi K3)."""
