"""``train`` prints the estimate in its start-up block and warns, naming the fixing flags, when it cannot fit."""

from __future__ import annotations

import logging

import pytest

import trainer_ext
from trainer_ext.job.flags import parse_train_args

pytestmark = pytest.mark.slow


def _args(tmp_path, *extra: str):
    return parse_train_args(
        [
            "--task",
            "causal-lm",
            "--max_steps",
            "1",
            "--output_dir",
            str(tmp_path),
            "--save_strategy",
            "no",
            "--save_final_model",
            "false",
            "--validation_split_percentage",
            "0",
            *extra,
        ]
    )


def test_startup_block_and_warning(tmp_path, capsys, caplog) -> None:
    args = _args(tmp_path)
    args.device_memory = "4MiB"  # what a --device_memory flag on train sets; on CPU there is no limit otherwise
    with caplog.at_level(logging.WARNING, logger="trainer_ext.estimate"):
        trainer_ext.train(args)
    out = capsys.readouterr().out
    assert "memory estimate per rank" in out and "optimizer states" in out and "largest micro-batch" in out
    assert out.index("memory estimate per rank") < out.index("one optimizer step")  # before training starts
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    message = next(m for m in warnings if "exceeds the device memory" in m)
    for flag in ("--per_device_train_batch_size", "--gradient_accumulation_steps", "checkpointing", "--deepspeed"):
        assert flag in message


def test_no_warning_without_a_limit_on_cpu(tmp_path, capsys, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="trainer_ext.estimate"):
        trainer_ext.train(_args(tmp_path))
    assert "memory estimate per rank" in capsys.readouterr().out
    assert not [r for r in caplog.records if "exceeds the device memory" in r.getMessage()]
