"""TRL's trainers under context parallelism (``cp_size=2``) on our engine, through ``trainer_ext.adapt``.

``trl_job`` (TRL's quick-start script, ``Trainer = adapt(Trainer)`` its one change) runs on 2 gloo ranks with the whole
batch on both (cp 2 × dp 1), the config passed as a TRL user does: ``SFTConfig(..., parallelism_config=
trainer_ext.ParallelismConfig(cp_size=2))`` (or a dict), or only the launcher's variables
(``trainer-ext launch --cp_size 2`` exports ``ACCELERATE_USE_PARALLELISM_CONFIG=true`` and
``PARALLELISM_CONFIG_CP_SIZE=2``, as ``accelerate launch`` does). SFT trains as on one process: the model runs our
context-parallel attention on half of each (padded) sequence, TRL's fused LM head scores the ``shift_labels`` the Trainer
built before the split; measured on CPU fp32, losses within 6.6e-8 relative and final weights within 7.3e-8.
TRL refuses packing with cp in its own line even when cp comes only from the launcher (trl#6843's hole). DPO and the
reward model cannot train exactly under cp (their losses read whole sequences): each is refused in one ConfigError
line before its first step. TRL's token metrics, gathered inside the split, count every cp rank's slice.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tests.helpers.ranks import run_ranks  # noqa: E402
from tests.with_trl.test_trl_trainers import _losses, _max_diff, _root  # noqa: E402
from tests.with_trl.test_trl_trainers import _run as one_process_run  # noqa: E402  (shared: the same cached run)

ROOT = Path(__file__).resolve().parents[2]
CP = 2
LOSS_RTOL = 1e-5  # fp32, another reduction order (attention over gathered keys, the loss summed over 2 slices)
WEIGHTS_ATOL = 1e-5
ATTENTION = "trainer_ext_context_parallel"  # the name our cp attention has in transformers' AttentionInterface
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")
EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception): ")
CP_REFUSAL = re.compile(r"^[\w.]*ConfigError: .*(cp_size|context parallel)")  # ours, in one line
PACKING_REFUSAL = "ValueError: Packing is not compatible with context parallelism (`cp_size > 1`)."


@dataclass
class Outcome:
    """One run on 2 ranks: whether it succeeded, its output (the tail of it), its result.json and final weights."""

    ok: bool
    output: str = field(repr=False)
    result: dict | None = field(default=None, repr=False)
    weights: dict[str, torch.Tensor] | None = field(default=None, repr=False)


def _outcome(out: Path, ok: bool, output: str) -> Outcome:
    if not ok or not (out / "result.json").exists():
        return Outcome(False, output)
    return Outcome(
        True, output, json.loads((out / "result.json").read_text()), load_file(out / "final" / "model.safetensors")
    )


@cache
def _configured(trainer: str, name: str, *argv: str) -> Outcome:
    """``trl_job --cp_size 2`` on 2 ranks: cp only from ``parallelism_config`` in the script's TRL config."""
    out = _root() / "cp" / name
    args = ["--trainer", trainer, "--impl", "ours", "--out", str(out), "--cp_size", str(CP), *argv]
    try:
        done = run_ranks("tests.with_trl.trl_job", CP, *args, timeout=600)
    except AssertionError as failed:  # the ranks' output follows the message's first line
        return Outcome(False, str(failed).split("\n", 1)[-1])
    return _outcome(out, True, done.stdout + done.stderr)


@cache
def _launched(trainer: str, name: str, *argv: str) -> Outcome:
    """``trainer-ext launch --cp_size 2 trl_job.py``: cp only from the launcher's variables (the script passes none)."""
    out = _root() / "cp" / name
    launch = ["-m", "trainer_ext", "launch", "--cpu", "--num_processes", str(CP), "--cp_size", str(CP)]
    job = [str(ROOT / "tests" / "with_trl" / "trl_job.py"), "--trainer", trainer, "--impl", "ours", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "TRAINER_EXT_CONFIG_FILE"}  # no launch config of the user's
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HOME=str(out.parent))
    done = subprocess.run(
        [sys.executable, *launch, *job, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    return _outcome(out, done.returncode == 0, done.stdout + done.stderr)


# every run of this module, made two at a time before its tests (each is mostly imports)
RUNS = (
    lambda: one_process_run("sft", "ours", "ours"),  # the same run test_trl_trainers compares 2 processes with
    lambda: _configured("sft", "sft"),
    lambda: _launched("sft", "sft_launched", "--save_steps", "100"),
    lambda: _launched("sft_packing", "sft_packing_launched", "--max_steps", "2"),
    lambda: _configured("dpo", "dpo", "--parallelism_config", "dict", "--max_steps", "2"),
    lambda: _configured("reward", "reward", "--max_steps", "2", "--save_steps", "100"),
)


@pytest.fixture(scope="module", autouse=True)
def _runs_two_at_a_time() -> None:
    def make(run: object) -> None:
        try:
            run()
        except Exception:  # not cached: the test that reads this run makes it again and fails with its output
            pass

    _root()  # one folder for every thread
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(make, RUNS))


def _failure_lines(outcome: Outcome) -> list[str]:
    """The exception lines of a failed run's output (one per rank that raised), without the launcher's rank prefix."""
    lines = (RANK_PREFIX.sub("", line).strip() for line in outcome.output.splitlines())
    return [line for line in lines if EXCEPTION_LINE.match(line)]


def _check_trains_as_one_process(cp: Outcome) -> None:
    one = one_process_run("sft", "ours", "ours")
    assert cp.ok, cp.output[-8000:]
    result = cp.result
    assert result["engine"] == "trainer_ext.distributed.engine.Engine" and result["world_size"] == CP
    assert one["attn_implementation"] == "sdpa" and result["attn_implementation"] == ATTENTION
    # the Trainer split every batch: each rank ran half of the sequence, padded to a multiple of 2 x cp chunks
    chunks = 2 * CP
    assert result["train_lengths"] == [-(-n // chunks) * chunks // CP for n in one["train_lengths"]]
    assert result["trained_steps"] == [1, 2, 3, 4, 5, 6]
    assert _losses(result).keys() == _losses(one).keys()
    relative = max(abs(result["steps"][s]["loss"] - loss) / abs(loss) for s, loss in _losses(one).items())
    weights = _max_diff(one["weights"], cp.weights)
    print(
        f"SFT cp {CP} vs 1 process: max relative loss difference {relative:.2e}, max weight difference {weights:.2e}"
    )
    for step, loss in _losses(one).items():
        assert result["steps"][step]["loss"] == pytest.approx(loss, rel=LOSS_RTOL), step
        assert result["steps"][step]["learning_rate"] == one["steps"][step]["learning_rate"], step
    assert weights <= WEIGHTS_ATOL


def test_sft_with_a_cp_parallelism_config_trains_as_one_process() -> None:
    """``SFTConfig(..., parallelism_config=ParallelismConfig(cp_size=2))``, the script otherwise unchanged."""
    _check_trains_as_one_process(_configured("sft", "sft"))


def test_sft_with_cp_from_the_launcher_variables_trains_as_with_the_config() -> None:
    """``trainer-ext launch --cp_size 2`` and a script that passes no parallelism_config: the same run, bitwise."""
    launched, configured = _launched("sft", "sft_launched", "--save_steps", "100"), _configured("sft", "sft")
    _check_trains_as_one_process(launched)
    assert configured.ok, configured.output[-8000:]
    assert launched.result["steps"] == configured.result["steps"]
    assert _max_diff(launched.weights, configured.weights) == 0.0


def test_trl_refuses_packing_when_cp_comes_only_from_the_launcher() -> None:
    """TRL reads cp off ``trainer.accelerator.parallelism_config`` (our engine's, built from the launcher's
    variables), so its own one-line ValueError stops the run before any step (trl#6843: a guard that read ``args``
    missed cp set by the launch)."""
    outcome = _launched("sft_packing", "sft_packing_launched", "--max_steps", "2")
    assert not outcome.ok, "packing with cp_size=2 trained"
    errors = _failure_lines(outcome)
    assert errors and all(line.startswith(PACKING_REFUSAL) for line in errors), errors
    assert "'loss'" not in outcome.output  # no step logged


def test_dpo_under_cp_is_refused_in_one_config_error_line() -> None:
    outcome = _configured("dpo", "dpo", "--parallelism_config", "dict", "--max_steps", "2")
    assert not outcome.ok
    errors = _failure_lines(outcome)
    assert errors and all(CP_REFUSAL.match(line) for line in errors), errors


def test_a_reward_model_under_cp_is_refused_not_trained_wrongly() -> None:
    outcome = _configured("reward", "reward", "--max_steps", "2", "--save_steps", "100")
    losses = outcome.result and _losses(outcome.result)
    assert not outcome.ok, f"the reward model trained under cp_size=2 (losses {losses})"
    errors = _failure_lines(outcome)
    assert errors and all(CP_REFUSAL.match(line) for line in errors), errors


def test_trl_token_metrics_under_cp_count_the_whole_sequences() -> None:
    """TRL gathers its token counts, entropy and accuracy with ``gather_for_metrics`` inside ``compute_loss``, on the
    cp slice (accelerate gathers every process; TRL: 'Context and sequence parallelism shard the batch before the loss
    is computed, so they need no such correction')."""
    one, cp = one_process_run("sft", "ours", "ours"), _configured("sft", "sft")
    assert cp.ok, cp.output[-8000:]
    for step, metrics in one["metrics"].items():
        assert cp.result["metrics"][step]["num_tokens"] == metrics["num_tokens"], step
        assert cp.result["metrics"][step]["entropy"] == pytest.approx(metrics["entropy"], rel=LOSS_RTOL), step
