#!/usr/bin/env bash
# Several machines, c10d rendezvous: the same training command as scripts/cpu.sh. Run it on every
# machine with the same NNODES, MASTER_ADDR and MASTER_PORT:
#   NNODES=2 MASTER_ADDR=10.0.0.1 scripts/multi_node.sh --max_steps 100      # on 10.0.0.1 and on the other one
# Set: NNODES (default 1), MASTER_ADDR (machine 0's address, required when NNODES > 1), MASTER_PORT
# (default 29500), NPROC_PER_NODE (default one per GPU, 1 without GPUs), DEVICE=cpu for CPU processes,
# DRY_RUN=1 to print the settings and the command. c10d numbers the machines itself; to fix each
# machine's rank instead, set RDZV_BACKEND=static and NODE_RANK (0 on MASTER_ADDR's machine).
# Keep MASTER_ADDR on a private network: torch.distributed's rendezvous store has no authentication.
set -euo pipefail
args=(--num_machines "${NNODES:-1}" --main_process_port "${MASTER_PORT:-29500}")
args+=(--rdzv_backend "${RDZV_BACKEND:-c10d}")
if [[ -n "${NODE_RANK:-}" ]]; then args+=(--machine_rank "$NODE_RANK"); fi
if [[ -n "${MASTER_ADDR:-}" ]]; then args+=(--main_process_ip "$MASTER_ADDR"); fi
if [[ -n "${NPROC_PER_NODE:-}" ]]; then args+=(--nproc_per_node "$NPROC_PER_NODE"); fi
if [[ "${DEVICE:-}" == cpu ]]; then args+=(--cpu); fi
if [[ -n "${DRY_RUN:-}" ]]; then args+=(--dry_run); fi
exec trainer-ext launch "${args[@]}" train "$@"
