#!/usr/bin/env bash
# FSDP2 x tensor parallelism (2-D) on this machine: each layer split over TP neighbouring processes (the model's
# own plan), and FSDP2 sharding everything across DP_SHARD such groups, each group on its own batch; DP_REPLICATE
# above 1 adds replicas of that (HSDP x TP). The same training command as scripts/cpu.sh, for a model with a
# tensor-parallel plan (llama, qwen2, mistral, ...):
#   scripts/fsdp_tp.sh --config configs/examples/causal_lm.yaml --bf16     # 4 GPUs: dp_shard 2 x tp 2
# With no --config, --model_name_or_path, --model_config or --task the job is configs/examples/causal_lm.yaml
# (a tiny Llama): the built-in default job is a BERT classifier, which has no tensor-parallel plan.
# Set: DP_SHARD (default 2), TP (default 2), DP_REPLICATE (default 1): DP_REPLICATE x DP_SHARD x TP processes;
# FSDP_CONFIG (an FSDP2 preset, e.g. configs/fsdp/full_shard.yaml; default: FSDP2's defaults), GPUS (default
# all), DEVICE=cpu for CPU processes (gloo), DRY_RUN=1 to print the settings, the mesh and the command.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
shard="${DP_SHARD:-2}" tp="${TP:-2}" replicas="${DP_REPLICATE:-1}"
for pair in "DP_SHARD=$shard" "TP=$tp" "DP_REPLICATE=$replicas"; do
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
args=(--num_machines 1 --num_processes "$((replicas * shard * tp))" --dp_shard_size "$shard" --tp_size "$tp")
if ((replicas > 1)); then args+=(--dp_replicate_size "$replicas"); fi
if [[ -n "${FSDP_CONFIG:-}" ]]; then args+=(--fsdp_config "$FSDP_CONFIG"); fi
if [[ "${DEVICE:-}" == cpu ]]; then
    args+=(--cpu)
else
    args+=(--gpu_ids "${GPUS:-all}")
fi
if [[ -n "${DRY_RUN:-}" ]]; then args+=(--dry_run); fi
exec trainer-ext launch "${args[@]}" train "${job[@]}" "$@"
