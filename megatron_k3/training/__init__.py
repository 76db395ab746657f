"""The training loop, checkpoints and metrics."""
