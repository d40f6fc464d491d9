#!/usr/bin/env bash
# One process on the CPU. Any `trainer-ext train` flag can follow, e.g.:
#   scripts/cpu.sh --config configs/examples/causal_lm.yaml --max_steps 50
set -euo pipefail
exec trainer-ext train --use_cpu "$@"
