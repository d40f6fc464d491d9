#!/usr/bin/env bash
# One process per visible GPU with DDP over NCCL: the same command as scripts/cpu.sh.
#   CUDA_VISIBLE_DEVICES=0,1 scripts/multi_gpu.sh --config configs/examples/causal_lm.yaml --bf16
set -euo pipefail
exec python -m torch.distributed.run --standalone --nproc_per_node gpu -m trainer_ext train "$@"
