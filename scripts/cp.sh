#!/usr/bin/env bash
# Context parallelism on this machine: every sequence split over CP processes (2 x CP chunks, load-balanced for
# causal attention), all of them on the same batch; attention brings the other ranks' keys and values to each rank's
# queries. The same training command as scripts/cpu.sh, for a causal LM with full attention (llama, qwen2, gpt2, ...;
# sliding-window and chunked models are refused before any process starts):
#   scripts/cp.sh --config configs/examples/causal_lm.yaml --bf16 --max_seq_length 8192
# With no --config, --model_name_or_path, --model_config or --task the job is configs/examples/causal_lm.yaml
# (a tiny Llama): the built-in default job is a BERT classifier, which context parallelism cannot split.
# Set: CP (default 2; context parallelism alone spans every process), DP_SHARD (default 1: above 1, FSDP2 shards
# over DP_SHARD x CP processes and DP_SHARD groups read different batches), CP_BACKEND (auto: torch's ring attention
# on CUDA, all_gather elsewhere; or torch, all_gather), GPUS (default all), DEVICE=cpu for CPU processes (gloo),
# DRY_RUN=1 to print the settings, the mesh and the command.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cp="${CP:-2}" shard="${DP_SHARD:-1}"
for pair in "CP=$cp" "DP_SHARD=$shard"; do
    if [[ ! "${pair#*=}" =~ ^[1-9][0-9]*$ ]]; then
        echo "$pair is not a process count: set ${pair%%=*} to a whole number such as 2" >&2
        exit 2
    fi
done
job=(--config "$ROOT/configs/examples/causal_lm.yaml")
for arg in "$@"; do
    case "${arg//-/_}" in
    __config | __config=* | __model_name_or_path | __model_name_or_path=* | __model_config | __model_config=* | __task | __task=*) job=() ;;
    esac
done
args=(--num_machines 1 --num_processes "$((shard * cp))" --cp_size "$cp")
if ((shard > 1)); then args+=(--dp_shard_size "$shard"); fi
if [[ -n "${CP_BACKEND:-}" ]]; then args+=(--cp_backend "$CP_BACKEND"); fi
if [[ "${DEVICE:-}" == cpu ]]; then
    args+=(--cpu)
else
    args+=(--gpu_ids "${GPUS:-all}")
fi
if [[ -n "${DRY_RUN:-}" ]]; then args+=(--dry_run); fi
exec trainer-ext launch "${args[@]}" train "${job[@]}" "$@"
