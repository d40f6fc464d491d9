#!/usr/bin/env bash
# Tensor parallelism on this machine: every layer split over TP processes by the model's own plan (Llama's
# q/k/v/gate/up by columns, o/down by rows), all of them on the same batch. The same training command as
# scripts/cpu.sh, for a model with a tensor-parallel plan (llama, qwen2, mistral, ...):
#   scripts/tp.sh --config configs/examples/causal_lm.yaml --bf16
# With no --config, --model_name_or_path, --model_config or --task the job is configs/examples/causal_lm.yaml
# (a tiny Llama): the built-in default job is a BERT classifier, which has no tensor-parallel plan.
# Set: TP (default 2; tensor parallelism alone spans every process), GPUS (default all), DEVICE=cpu for CPU
# processes (gloo), DRY_RUN=1 to print the settings, the mesh and the command. To shard across TP groups too,
# use scripts/fsdp_tp.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tp="${TP:-2}"
if [[ ! "$tp" =~ ^[1-9][0-9]*$ ]]; then
    echo "TP=$tp is not a process count: set TP to a whole number such as 2" >&2
    exit 2
fi
job=(--config "$ROOT/configs/examples/causal_lm.yaml")
for arg in "$@"; do
    case "${arg//-/_}" in
    __config | __config=* | __model_name_or_path | __model_name_or_path=* | __model_config | __model_config=* | __task | __task=*) job=() ;;
    esac
done
args=(--num_machines 1 --num_processes "$tp" --tp_size "$tp")
if [[ "${DEVICE:-}" == cpu ]]; then
    args+=(--cpu)
else
    args+=(--gpu_ids "${GPUS:-all}")
fi
if [[ -n "${DRY_RUN:-}" ]]; then args+=(--dry_run); fi
exec trainer-ext launch "${args[@]}" train "${job[@]}" "$@"
