#!/usr/bin/env bash
# FSDP2 (fully_shard) on the GPUs of this machine: the same training command as scripts/cpu.sh.
#   scripts/fsdp.sh --config configs/examples/causal_lm.yaml --bf16
# Checkpoints are sharded (one part per process); the final model in output_dir is consolidated safetensors.
# Set: FSDP_CONFIG (default configs/fsdp/full_shard.yaml), GPUS (default all), NPROC (default one per
# GPU), DEVICE=cpu for CPU processes (FSDP2 runs on gloo), DRY_RUN=1 to print the settings and the
# command.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
args=(--num_machines 1 --fsdp_config "${FSDP_CONFIG:-$ROOT/configs/fsdp/full_shard.yaml}")
if [[ "${DEVICE:-}" == cpu ]]; then
    args+=(--cpu --num_processes "${NPROC:-2}")
else
    args+=(--gpu_ids "${GPUS:-all}")
    if [[ -n "${NPROC:-}" ]]; then args+=(--nproc_per_node "$NPROC"); fi
fi
if [[ -n "${DRY_RUN:-}" ]]; then args+=(--dry_run); fi
exec trainer-ext launch "${args[@]}" train "$@"
