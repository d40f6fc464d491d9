#!/usr/bin/env bash
# One process on one GPU: the same training command as scripts/cpu.sh.
# Set GPU (default 0), the index of the GPU to use; DRY_RUN=1 prints the settings and the command:
#   GPU=1 scripts/single_gpu.sh --config configs/examples/causal_lm.yaml --bf16
set -euo pipefail
args=(--num_machines 1 --num_processes 1 --gpu_ids "${GPU:-0}")
if [[ -n "${DRY_RUN:-}" ]]; then args+=(--dry_run); fi
exec trainer-ext launch "${args[@]}" train "$@"
