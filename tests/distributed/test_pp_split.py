"""The pipeline's pure parts in this process: the balanced split of decoder layers into stages, the stages each
schedule puts on a rank, the bubble model, and the reasons a model cannot be split."""

from __future__ import annotations

import itertools

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from trainer_ext.distributed.pipeline import schedules, split
from trainer_ext.errors import ConfigError


def brute_force(weights: list[int], first: int, last: int, stages: int) -> int:
    """The smallest largest-stage cost over every split into ``stages`` non-empty consecutive runs."""
    n, best = len(weights), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        costs = [sum(weights[a:b]) for a, b in itertools.pairwise(bounds)]
        costs[0] += first
        costs[-1] += last
        best = max(costs) if best is None else min(best, max(costs))
    return best


@pytest.mark.parametrize(
    ("weights", "first", "last", "stages"),
    [
        ([10] * 4, 0, 0, 2),
        ([10] * 4, 25, 0, 2),
        ([1] * 6, 0, 10, 3),
        ([5, 1, 1, 1, 9, 2, 2], 3, 4, 3),
        ([7] * 4, 1, 1, 4),
    ],
)
def test_balance_splits_into_consecutive_runs_minimising_the_largest_stage(weights, first, last, stages) -> None:
    ranges = split.balance(weights, first, last, stages)
    assert len(ranges) == stages and ranges[0][0] == 0 and ranges[-1][1] == len(weights)
    assert all(a < b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(stages - 1))
    costs = [sum(weights[a:b]) for a, b in ranges]
    costs[0] += first
    costs[-1] += last
    assert max(costs) == brute_force(weights, first, last, stages)


def test_the_embeddings_move_layers_off_the_first_stage() -> None:
    assert split.balance([10] * 4, 0, 0, 2) == [(0, 2), (2, 4)]
    assert split.balance([10] * 4, 25, 0, 2) == [(0, 1), (1, 4)]


@pytest.mark.parametrize("name", list(schedules.SCHEDULES))
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_every_stage_is_held_by_exactly_one_rank(name: str, pp: int) -> None:
    held = [schedules.stage_ids(name, rank, pp) for rank in range(pp)]
    per_rank = schedules.stages_per_rank(name)
    assert all(len(ids) == per_rank and ids == sorted(ids) for ids in held)
    assert sorted(itertools.chain(*held)) == list(range(pp * per_rank))
    assert all(schedules.owner_of_stage(name, s, pp) == r for r, ids in enumerate(held) for s in ids)
    assert schedules.default_microbatches(name, pp) == pp * per_rank


def test_the_layouts_loop_or_make_a_v() -> None:
    assert [schedules.stage_ids("interleaved_1f1b", r, 2) for r in range(2)] == [[0, 2], [1, 3]]
    assert [schedules.stage_ids("zbv_zero_bubble", r, 2) for r in range(2)] == [[0, 3], [1, 2]]
    assert [schedules.stage_ids("1f1b", r, 4) for r in range(4)] == [[0], [1], [2], [3]]


def test_the_bubble_shrinks_with_microbatches_interleaving_and_zero_bubble() -> None:
    assert schedules.bubble_fraction("1f1b", 1, 8) == 0.0
    assert schedules.bubble_fraction("gpipe", 4, 4) == pytest.approx(3 / 7)
    assert schedules.bubble_fraction("1f1b", 4, 12) == pytest.approx(3 / 15)
    assert schedules.bubble_fraction("interleaved_1f1b", 4, 4) == pytest.approx(1.5 / 5.5)
    assert schedules.bubble_fraction("zbv_zero_bubble", 4, 4) == pytest.approx(1.5 / 5.5 / 3)
    assert schedules.bubble_fraction("1f1b", 4, 8) < schedules.bubble_fraction("1f1b", 4, 4)


def test_an_unknown_schedule_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="pp_schedule 'dualpipe' is unknown: choose 1f1b, gpipe, "):
        schedules.stages_per_rank("dualpipe")


def tiny(model_type: str, **settings):
    shape = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, vocab_size=32)
    config = AutoConfig.for_model(model_type, **{**shape, "num_hidden_layers": 4, **settings})
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (lambda: tiny("llama"), None),
        (lambda: tiny("qwen2"), None),
        (lambda: tiny("llama", tie_word_embeddings=True), "ties lm_head to its input embeddings"),
        (lambda: tiny("gpt2"), "GPT2LMHeadModel (gpt2) is not a decoder the pipeline splits"),
        (lambda: tiny("mistral", sliding_window=8), "uses sliding-window attention"),
        (lambda: tiny("llama", num_hidden_layers=1), "has 1 decoder layers, fewer than the 2 pipeline stages"),
    ],
)
def test_why_a_model_cannot_be_split(build, reason) -> None:
    got = split.why_not(build(), 2)
    assert got == reason if reason is None else reason in got
    if reason is not None:
        with pytest.raises(ConfigError, match="^pipeline parallelism: .*; set pp_size=1") as error:
            split.check_model(build(), 2)
        assert "\n" not in str(error.value)
