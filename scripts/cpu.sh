#!/usr/bin/env bash
# One process on the CPU (no rendezvous). Nothing to set; any `trainer-ext train` flag can follow:
#   scripts/cpu.sh --config configs/examples/causal_lm.yaml --max_steps 50
# DRY_RUN=1 prints the resolved launch settings and the command instead of running it. Settings this
# script does not fix (mixed_precision, gradient_accumulation_steps) come from the launch config if
# there is one ($TRAINER_EXT_CONFIG_FILE or ~/.cache/trainer_ext/default_config.yaml).
set -euo pipefail
args=(--cpu --num_machines 1 --num_processes 1)
if [[ -n "${DRY_RUN:-}" ]]; then args+=(--dry_run); fi
exec trainer-ext launch "${args[@]}" train "$@"
