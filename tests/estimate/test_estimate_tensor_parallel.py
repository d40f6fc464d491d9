"""``trainer-ext estimate`` with parallel sizes: per-rank figures against a by-hand count of the tiny-llama preset
(docs/estimate.md's tensor-parallel model), the mesh line, the process count taken from the sizes, and the refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainer_ext.cli.main import main
from trainer_ext.distributed.mesh.config import ParallelismConfig
from trainer_ext.estimate.startup import setup_for

# the tiny-llama preset (trainer_ext.job.fields.PRESETS), as `--task causal-lm` builds it from scratch
H, LAYERS, HEADS, KV_HEADS, INTER = 64, 2, 4, 2, 128
HEAD_DIM = H // HEADS
KV = KV_HEADS * HEAD_DIM
BATCH, SEQ = 32, 128  # the from-scratch default batch, --max_seq_length


def by_hand(vocab: int, tp: int, shards: int) -> dict[str, float]:
    """Weights, gradients, AdamW states and activations (fp32) of one rank, counted from the architecture."""
    split_layer = 2 * H * H + 2 * H * KV + 3 * H * INTER  # q, o; k, v; gate, up, down: the plan's linears
    whole_layer = 2 * H  # the two RMSNorm weights
    split = LAYERS * split_layer + vocab * H  # + the tied embedding / lm_head, vocabulary-split by the plan
    whole = LAYERS * whole_layer + H  # + the final norm
    local = whole + split / tp
    per_layer = (4 * H + 2) + (4 * H + 2 * KV + 4 * INTER + HEADS) / tp  # norms whole, attention/MLP insides split
    outer = 3 * H + HEAD_DIM + 5
    tokens = BATCH * SEQ
    activations = tokens * ((LAYERS * per_layer + outer) * 4 + 4 * vocab) + 12 * tokens * SEQ
    return {
        "weights": 4 * local / shards,
        "gradients": 4 * local / shards,
        "optimizer": 8 * local / shards,
        "activations": activations,
    }


def run_estimate(tmp_path, capsys, *sizes: str) -> tuple[dict, str]:
    out = tmp_path / f"estimate{'-'.join(sizes)}.json"
    assert main(["estimate", "--task", "causal-lm", "--json", str(out), *sizes]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_per_rank_figures_fall_with_tp_size_as_the_documented_model_says(tmp_path, capsys):
    figures = {}
    for sizes, tp, shards in (
        ((), 1, 1),
        (("--tp_size", "2"), 2, 1),
        (("--tp_size", "2", "--dp_shard_size", "2"), 2, 2),
    ):
        document, out = run_estimate(tmp_path, capsys, *sizes)
        vocab = int(re.search(r"vocabulary (\d+)", out).group(1))
        expected = by_hand(vocab, tp, shards)
        for key, value in expected.items():
            assert document["estimated"][key] == int(value), (sizes, key)
        assert document["setup"]["world_size"] == tp * shards  # no --num_processes: the sizes' product
        assert document["setup"]["tp_size"] == tp
        figures[sizes] = document["estimated"]
    plain, tp2, both = figures.values()
    for key in ("weights", "gradients", "optimizer", "activations"):
        assert tp2[key] < plain[key]
    assert both["weights"] == int(by_hand(vocab, 2, 1)["weights"] / 2)  # FSDP2 shards what TP left
    assert both["activations"] == tp2["activations"]  # sharding the states does not split the activations


def test_the_mesh_is_printed(tmp_path, capsys):
    _, out = run_estimate(tmp_path, capsys, "--tp_size", "2", "--dp_shard_size", "2")
    assert "mesh: dp_shard 2 x tp 2 (2 data-parallel ranks)" in out.splitlines()
    assert "tensor parallel 2 x FSDP2 full_shard (mesh dp_shard 2 x tp 2) on 4 processes" in out
    _, out = run_estimate(tmp_path, capsys, "--num_processes", "4", "--dp_replicate_size", "2", "--dp_shard_size", "2")
    assert "mesh: dp_replicate 2 x dp_shard 2 (4 data-parallel ranks)" in out.splitlines()
    assert "FSDP2 full_shard (hybrid: 2 replicas of 2 shards) on 4 processes" in out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--task", "causal-lm", "--num_processes", "4", "--tp_size", "2"], "but the job has 4"),
        (["--cp_size", "2"], "cp_size 2: context parallelism splits causal language models' sequences"),
        (["--task", "causal-lm", "--tp_size", "4"], "needs num_key_value_heads (2) of the model divisible by 4"),
        (["--tp_size", "2"], "bert model without a tensor-parallel plan"),
        (
            ["--task", "causal-lm", "--tp_size", "2", "--deepspeed", "configs/deepspeed/zero2.json"],
            "--tp_size 2 with --deepspeed",
        ),
    ],
    ids=["world", "cp", "kv-heads", "no-plan", "deepspeed"],
)
def test_bad_sizes_exit_2_in_one_line(argv, words, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_the_start_up_estimate_reads_the_jobs_parallelism_config():
    args = SimpleNamespace(
        bf16=False,
        fp16=False,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        optim="adamw_torch",
        optim_args=None,
        activation_checkpointing=False,
        gradient_checkpointing=False,
        deepspeed=None,
        fsdp_plugin_args=None,
        parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2),
    )
    setup = setup_for(args, 8, 64)
    assert (setup.strategy, setup.tp_size, setup.replicate, setup.shards, setup.data_parallel) == ("fsdp", 2, 2, 2, 4)
    assert setup.mesh == "dp_replicate 2 x dp_shard 2 x tp 2"
    args.parallelism_config = None
    assert setup_for(args, 8, 64).tp_size == 1
