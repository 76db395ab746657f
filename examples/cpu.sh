#!/usr/bin/env bash
# Train the tiny K3 on this machine's CPUs (the same as `make train`, with a few common overrides shown).
set -euo pipefail
cd "$(dirname "$0")/.."
make install
.venv/bin/python -m megatron_k3.train model=k3_tiny cluster=cpu \
    train.steps=${STEPS:-200} train.seq_length=256 train.micro_batch_size=4 train.global_batch_size=8 \
    logging.wandb.mode=offline "$@"
