#!/usr/bin/env bash
# N CPU processes on this machine, DDP over gloo: the same training command as scripts/cpu.sh.
# Set NPROC (default 2); DRY_RUN=1 prints the settings and the command instead:
#   NPROC=4 scripts/multi_cpu.sh --config configs/examples/default.yaml
set -euo pipefail
args=(--cpu --num_machines 1 --num_processes "${NPROC:-2}")
if [[ -n "${DRY_RUN:-}" ]]; then args+=(--dry_run); fi
exec trainer-ext launch "${args[@]}" train "$@"
