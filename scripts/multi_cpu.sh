#!/usr/bin/env bash
# N CPU processes on this machine with DDP over gloo (default 2): the same command as scripts/cpu.sh.
#   NPROC=4 scripts/multi_cpu.sh --config configs/examples/default.yaml
set -euo pipefail
exec python -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-2}" \
    -m trainer_ext train --use_cpu "$@"
