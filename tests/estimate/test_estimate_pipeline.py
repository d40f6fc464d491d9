"""``trainer-ext estimate`` with pipeline parallelism: the busiest stage rank's memory falls with pp_size (its
layers' states, by the pipeline's balance split), activations follow the microbatches in flight per schedule, the
bubble per schedule is in the mesh line, and a model the pipeline cannot split is refused (exit 2, one line)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from trainer_ext.cli.main import main
from trainer_ext.distributed.pipeline.schedules import bubble_fraction
from trainer_ext.estimate.breakdown import estimate
from trainer_ext.estimate.pipeline import in_flight, outer_elements_not_saved, rank_parts, stage_ranges
from trainer_ext.estimate.setup import setup_from_values
from trainer_ext.estimate.shape import ModelShape

LLAMA = dict(
    model_type="llama",
    hidden_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    max_position_embeddings=256,
    vocab_size=32,
    tie_word_embeddings=False,
)
H, INTER, KV, VOCAB = 64, 256, 32, 32
LAYER = 2 * H * H + 2 * H * KV + 3 * H * INTER + 2 * H  # q, o, k, v, gate/up/down, two norms


def shape(layers: int = 8) -> ModelShape:
    params = layers * LAYER + 2 * VOCAB * H + H  # untied embedding and head, final norm
    return ModelShape(
        model_type="llama",
        params=params,
        trainable=params,
        layer_params=LAYER,
        num_layers=layers,
        hidden=H,
        intermediate=INTER,
        heads=4,
        kv_heads=2,
        vocab=VOCAB,
        causal_lm=True,
    )


def setup(pp: int = 1, world: int | None = None, **values):
    sizes = {"pp_size": pp, "per_device_train_batch_size": 8, **values}
    return setup_from_values(sizes, world or pp, 64)


def test_per_stage_states_fall_with_pp_by_the_balance_split():
    whole = estimate(shape(), setup())
    for pp in (2, 4):
        part = estimate(shape(), setup(pp))
        layers = max(b - a for a, b in stage_ranges(shape(), setup(pp)))
        # the busiest rank: its layers and at most the embedding or the head (balance puts fewer layers with them)
        assert layers == 8 // pp
        assert part.weights <= 4 * (layers * LAYER + VOCAB * H + H)
        assert part.weights < whole.weights / pp * 1.3
        assert part.optimizer == 2 * part.weights  # AdamW: two fp32 moments per parameter held
        assert part.activations < whole.activations
        assert part.peak < whole.peak
    # dp_shard over the rest shards each stage's states further
    sharded = estimate(shape(), setup(2, world=4, dp_shard_size=2))
    assert sharded.weights == pytest.approx(estimate(shape(), setup(2)).weights / 2, rel=0.01)


def _one_microbatch_per_rank(values) -> list[int]:
    """Each pipeline rank's activations for one microbatch: its part's, less the outside terms only the last stage
    saves."""
    parts, inner, micro, _ = rank_parts(shape(), values, 8)
    return [
        estimate(part, inner, micro).activations
        - int(outer_elements_not_saved(shape(), values, rank) * micro * inner.local_seq_len * inner.compute_bytes)
        for rank, part in enumerate(parts)
    ]


def test_activations_follow_the_microbatches_in_flight():
    onef_setup, gpipe_setup = (setup(2, pp_schedule=name, pp_microbatches=8) for name in ("1f1b", "gpipe"))
    assert in_flight(onef_setup) == 2
    assert [in_flight(onef_setup, rank) for rank in (0, 1)] == [2, 1]  # 1F1B: pp_size - rank
    assert [in_flight(gpipe_setup, rank) for rank in (0, 1)] == [8, 8]
    assert in_flight(setup(2, pp_schedule="interleaved_1f1b", pp_microbatches=8), 1) == 2
    first, last = _one_microbatch_per_rank(onef_setup)
    assert 0 < first < last  # the last stage saves the final norm, the head's input and the logits
    onef = estimate(shape(), onef_setup).activations
    gpipe = estimate(shape(), gpipe_setup).activations
    assert onef == pytest.approx(max(2 * first, last), rel=0.01)
    assert gpipe == pytest.approx(8 * last, rel=0.01)  # 8 microbatches of 1 sequence in flight on every rank
    assert gpipe == pytest.approx(estimate(shape(), setup(2, pp_schedule="gpipe")).activations, rel=0.01)


@pytest.mark.parametrize(
    ("schedule", "microbatches"),
    [("1f1b", 4), ("gpipe", 8), ("interleaved_1f1b", 4), ("looped_bfs", 4), ("zbv_zero_bubble", 4)],
)
def test_the_mesh_line_has_the_bubble_of_the_schedule(tmp_path, capsys, schedule, microbatches):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(LLAMA))
    argv = ["--task", "causal-lm", "--model_config", str(path), "--max_seq_length", "32", "--pp_size", "2"]
    argv += ["--pp_schedule", schedule, "--pp_microbatches", str(microbatches)]
    assert main(["estimate", *argv]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("mesh:"))
    bubble = bubble_fraction(schedule, 2, microbatches)
    assert f"{schedule}, {microbatches} microbatches, bubble {bubble:.0%}" in line
    stages = 2 if schedule in ("1f1b", "gpipe") else 4
    assert re.search(rf"pipeline {stages} stages( on 2 ranks)? \(layers 0-\d+ \|", line), line
    assert (
        bubble_fraction("1f1b", 2, 4)
        > bubble_fraction("interleaved_1f1b", 2, 4)
        > bubble_fraction("interleaved_zero_bubble", 2, 4)
    )


def test_a_model_the_pipeline_cannot_split_is_refused(tmp_path, capsys):
    tied = Path(tmp_path) / "tied.json"
    tied.write_text(json.dumps({**LLAMA, "tie_word_embeddings": True}))
    argv = ["--task", "causal-lm", "--model_config", str(tied), "--max_seq_length", "32", "--pp_size", "2"]
    assert main(["estimate", *argv]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "pipeline of 2 stages" in errors[0] and "ties lm_head" in errors[0], errors
    assert main(["estimate", "--task", "causal-lm", "--model_config", "tiny-gpt2", "--pp_size", "2"]) == 2
    assert "is not a decoder the pipeline splits" in capsys.readouterr().err


def test_tensor_parallelism_splits_each_stage_further():
    """pp 2 x tp 2: the plan's share of the rank's stages is split over the tp ranks (the norms stay whole)."""
    split = LAYER - 2 * H  # the linears of a layer; its two norms are left whole
    planned = dataclasses.replace(
        shape(), tp_params=8 * split + 2 * VOCAB * H, tp_trainable=8 * split + 2 * VOCAB * H, tp_layer_params=split
    )
    alone = estimate(planned, setup(2))
    with_tp = estimate(planned, setup(2, world=4, tp_size=2))
    assert with_tp.weights < alone.weights * 0.6
    assert with_tp.weights > alone.weights * 0.45
