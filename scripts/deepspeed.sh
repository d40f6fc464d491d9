#!/usr/bin/env bash
# DeepSpeed ZeRO on the GPUs of this machine: the same training command as scripts/cpu.sh.
#   scripts/deepspeed.sh --config configs/examples/causal_lm.yaml --bf16
# Needs the extra (from the checkout): DS_BUILD_OPS=0 pip install -e ".[deepspeed]".
# Set: DS_CONFIG (default configs/deepspeed/zero2.json), GPUS (default all), NPROC (default one per
# GPU), DEVICE=cpu for CPU processes (DeepSpeed's CPU accelerator, DS_ACCELERATOR=cpu), DRY_RUN=1 to
# print the settings and the command.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
args=(--num_machines 1 --deepspeed "${DS_CONFIG:-$ROOT/configs/deepspeed/zero2.json}")
if [[ "${DEVICE:-}" == cpu ]]; then
    export DS_ACCELERATOR=cpu
    args+=(--cpu --num_processes "${NPROC:-2}")
else
    args+=(--gpu_ids "${GPUS:-all}")
    if [[ -n "${NPROC:-}" ]]; then args+=(--nproc_per_node "$NPROC"); fi
fi
if [[ -n "${DRY_RUN:-}" ]]; then args+=(--dry_run); fi
exec trainer-ext launch "${args[@]}" train "$@"
