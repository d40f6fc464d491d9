#!/usr/bin/env bash
# One process per GPU of this machine, DDP over NCCL: the same training command as scripts/cpu.sh.
# Set GPUS (default all; e.g. GPUS=0,1), NPROC only to start fewer processes than GPUs; DRY_RUN=1
# prints the settings and the command:
#   GPUS=0,1 scripts/multi_gpu.sh --config configs/examples/causal_lm.yaml --bf16
set -euo pipefail
args=(--num_machines 1 --gpu_ids "${GPUS:-all}")
if [[ -n "${NPROC:-}" ]]; then args+=(--nproc_per_node "$NPROC"); fi
if [[ -n "${DRY_RUN:-}" ]]; then args+=(--dry_run); fi
exec trainer-ext launch "${args[@]}" train "$@"
