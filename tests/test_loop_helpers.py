"""``find_executable_batch_size``, ``set_seed`` and ``get_logger``: the helpers accelerate's example loops import,
from ``trainer_ext`` (the accelerator parity scenario ``memory_example`` compares them with accelerate's on 1 and 2
processes)."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
import transformers

import trainer_ext
from trainer_ext import find_executable_batch_size, get_logger, set_seed


def _fails_above(limit: int, tried: list[int]):
    def train(batch_size: int, scale: float = 1.0) -> float:
        tried.append(batch_size)
        if batch_size > limit:
            torch.empty(2**62, dtype=torch.uint8)  # the real CPU allocator error
        return batch_size * scale

    return train


def test_the_batch_shrinks_by_a_tenth_until_it_fits():
    tried: list[int] = []
    run = find_executable_batch_size(_fails_above(100, tried), starting_batch_size=128)
    assert run(scale=2.0) == 184.0
    assert tried == [128, 115, 103, 92]
    assert run.__name__ == "train"


def test_as_a_decorator_with_a_reduction_of_ones_own():
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=64, reduce_batch_size_fn=lambda: tried[-1] // 2)
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 10:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size

    assert train() == 8 and tried == [64, 32, 16, 8]


def test_zero_is_an_error_and_other_errors_are_not_retried():
    tried: list[int] = []
    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero."):
        find_executable_batch_size(_fails_above(0, tried), starting_batch_size=4)()
    assert tried == [4, 3, 2, 1]

    calls: list[int] = []

    @find_executable_batch_size(starting_batch_size=8)
    def broken(batch_size: int) -> None:
        calls.append(batch_size)
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError, match="a bug"):
        broken()
    assert calls == [8]


def test_passing_the_batch_size_yourself_is_refused():
    run = find_executable_batch_size(_fails_above(100, []), starting_batch_size=8)
    with pytest.raises(TypeError, match="Batch size was passed into `train` as the first argument"):
        run(8, 2.0)


def test_set_seed_seeds_what_transformers_seeds():
    set_seed(123)
    ours = (random.random(), np.random.rand(), torch.rand(3))
    transformers.set_seed(123)
    theirs = (random.random(), np.random.rand(), torch.rand(3))
    assert ours[:2] == theirs[:2] and torch.equal(ours[2], theirs[2])


def test_a_device_specific_seed_adds_the_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    set_seed(10, device_specific=True)
    ours = torch.rand(2)
    torch.manual_seed(11)
    assert torch.equal(ours, torch.rand(2))


def test_set_seed_deterministic_turns_on_deterministic_algorithms():
    before = torch.are_deterministic_algorithms_enabled()
    try:
        set_seed(0, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


def test_the_logger_prefixes_the_rank_and_logs_each_message_once(caplog):
    logger = get_logger("tests.loop_helpers.main", log_level="INFO")
    with caplog.at_level(logging.INFO, logger="tests.loop_helpers.main"):
        logger.info("hello")
        logger.info("everyone", main_process_only=False)
        logger.info("in turn", in_order=True)  # one process, no group: logged once
        logger.warning_once("careful")
        logger.warning_once("careful")
        logger.debug("too detailed")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "[RANK 0] hello"),
        ("INFO", "[RANK 0] everyone"),
        ("INFO", "[RANK 0] in turn"),
        ("WARNING", "[RANK 0] careful"),
    ]
    assert caplog.records[0].filename == "test_loop_helpers.py"  # the caller's line, not ours


def test_other_ranks_log_only_when_asked(monkeypatch, caplog):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    logger = get_logger("tests.loop_helpers.other")
    with caplog.at_level(logging.INFO, logger="tests.loop_helpers.other"):
        logger.info("main only")
        logger.info("from every rank", main_process_only=False)
    assert [r.getMessage() for r in caplog.records] == ["[RANK 1] from every rank"]


def test_the_level_comes_from_accelerates_variable(monkeypatch):
    monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "debug")
    root_level = logging.getLogger().level
    try:
        logger = get_logger("tests.loop_helpers.level")
        assert logger.logger.level == logging.DEBUG and logger.isEnabledFor(logging.DEBUG)
    finally:
        logging.getLogger().setLevel(root_level)


def test_they_are_public_names():
    assert {"find_executable_batch_size", "set_seed", "get_logger"} <= set(trainer_ext.__all__)


def test_skip_first_batches_is_accelerates_top_level_function() -> None:
    """``from accelerate import skip_first_batches`` migrates to ``from trainer_ext import skip_first_batches``: on a
    prepared loader it is the Accelerator's method, on a plain one the first batches are read and dropped."""
    from torch.utils.data import DataLoader

    from trainer_ext import Accelerator, skip_first_batches

    plain = DataLoader(list(range(10)), batch_size=3)
    assert [b.tolist() for b in skip_first_batches(plain, 2)] == [[6, 7, 8], [9]]
    assert len(skip_first_batches(plain, 1)) == 3
    prepared = Accelerator(cpu=True).prepare(DataLoader(list(range(10)), batch_size=3))
    assert [b.tolist() for b in skip_first_batches(prepared, 3)] == [[9]]
