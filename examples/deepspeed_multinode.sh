#!/usr/bin/env bash
# The same entry point under DeepSpeed's launcher across nodes (pdsh/ssh to every host of a hostfile).
#   hostfile lines: "node01 slots=8"; run this on the first host:  HOSTFILE=hostfile bash examples/deepspeed_multinode.sh
# On one machine (CPU included):  deepspeed --num_gpus 2 --master_port 29534 megatron_k3/train.py ...
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/k3-ds-$(date +%Y%m%d-%H%M%S)}
.venv/bin/deepspeed --hostfile "${HOSTFILE:-hostfile}" --master_port "${MASTER_PORT:-29542}" megatron_k3/train.py \
    model=${MODEL:-k3_small} cluster=single_node precision=bf16 train.device=cuda \
    parallel.tp=${TP:-2} parallel.sequence_parallel=true parallel.zero_stage=${ZERO:-1} \
    train.seq_length=4096 train.micro_batch_size=1 train.global_batch_size=${GBS:-64} \
    train.save_interval=500 checkpoint.load=auto hydra.run.dir="$RUN_DIR" "$@"
