#!/usr/bin/env bash
# k3_small (2.56B total / 0.82B active, every K3 feature) on one 141 GB GPU, bf16 autocast.
# On CUDA with fla installed (requirements-gpu.txt) KDA dispatches to fla's fused Triton kernel.
set -euo pipefail
cd "$(dirname "$0")/.."
make install
.venv/bin/pip install -q -r requirements-gpu.txt || echo "GPU extras not installed; using the torch paths"
.venv/bin/python -m megatron_k3.train model=k3_small cluster=single_node precision=bf16 \
    train.device=cuda train.seq_length=4096 train.micro_batch_size=1 train.global_batch_size=32 \
    train.steps=${STEPS:-2000} train.save_interval=250 optim.lr=1e-3 optim.min_lr=1e-4 optim.warmup_steps=20 \
    logging.wandb.mode=${WANDB_MODE:-offline} checkpoint.load=auto hydra.run.dir=${RUN_DIR:-runs/k3_small} "$@"
