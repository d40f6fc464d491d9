#!/usr/bin/env bash
# Pipeline parallelism on this machine: the decoder layers cut into PP consecutive stages, one per process (two with
# an interleaved or zero-bubble schedule), each batch streamed through them in microbatches; the processes of one
# pipeline read the same batch. The same training command as scripts/cpu.sh, for a causal LM the pipeline splits
# (llama, mistral, qwen2, qwen3 with untied embeddings and at least one decoder layer per stage; anything else is
# refused before any process starts):
#   scripts/pp.sh --config configs/examples/causal_lm.yaml --model_config untied_llama.json --bf16
# With no --config, --model_name_or_path, --model_config or --task the job is configs/examples/causal_lm.yaml with
# the preset tiny-llama-untied (4 layers, its own lm_head): the example's tiny-llama ties its embeddings, which the
# pipeline cannot split, and the built-in default job is a BERT classifier.
# Set: PP (default 2; pipeline parallelism alone spans every process), DP_SHARD (default 1: above 1, FSDP2 shards each
# stage over DP_SHARD processes, which read different batches; DP_SHARD x PP processes), PP_SCHEDULE (1f1b; gpipe,
# interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv_zero_bubble), PP_MICROBATCHES (default one per stage;
# trainer-ext launch checks both), GPUS (default all), DEVICE=cpu for CPU processes (gloo), DRY_RUN=1 to print the
# settings, the mesh and the command.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
pp="${PP:-2}" shard="${DP_SHARD:-1}"
for pair in "PP=$pp" "DP_SHARD=$shard"; do
    if [[ ! "${pair#*=}" =~ ^[1-9][0-9]*$ ]]; then
        echo "$pair is not a process count: set ${pair%%=*} to a whole number such as 2" >&2
        exit 2
    fi
done
job=(--config "$ROOT/configs/examples/causal_lm.yaml" --model_config tiny-llama-untied)
for arg in "$@"; do
    case "${arg//-/_}" in
    __config | __config=* | __model_name_or_path | __model_name_or_path=* | __model_config | __model_config=* | __task | __task=*) job=() ;;
    esac
done
args=(--num_machines 1 --num_processes "$((shard * pp))" --pp_size "$pp")
if ((shard > 1)); then args+=(--dp_shard_size "$shard"); fi
if [[ -n "${PP_SCHEDULE:-}" ]]; then args+=(--pp_schedule "$PP_SCHEDULE"); fi
if [[ -n "${PP_MICROBATCHES:-}" ]]; then args+=(--pp_microbatches "$PP_MICROBATCHES"); fi
if [[ "${DEVICE:-}" == cpu ]]; then
    args+=(--cpu)
else
    args+=(--gpu_ids "${GPUS:-all}")
fi
if [[ -n "${DRY_RUN:-}" ]]; then args+=(--dry_run); fi
exec trainer-ext launch "${args[@]}" train "${job[@]}" "$@"
