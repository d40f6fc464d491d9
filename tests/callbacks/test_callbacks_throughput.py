"""ThroughputCallback on one process: the values in each training log line, the FLOPs formula, the peak table."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from tests.helpers.jobs import make_args
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.callbacks import ThroughputCallback
from trainer_ext.callbacks.throughput import flops_shape, lookup_peak_flops, matmul_params, training_flops_per_token

KEYS = {"samples_per_second", "tokens_per_second", "mfu", "peak_memory_mib"}


class SeenInOnLog(TrainerCallback):
    """Remembers the throughput keys present in ``logs`` when its own ``on_log`` runs, and the wall time of each."""

    def __init__(self) -> None:
        self.seen: list[set[str]] = []
        self.times: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.seen.append(KEYS & logs.keys())
            self.times.append(time.perf_counter())


class SlowEvaluation(TrainerCallback):
    """The evaluation at step 1 takes one more second (placed before the throughput callback)."""

    def on_evaluate(self, args, state, control, **kwargs):
        if state.global_step == 1:
            time.sleep(1.0)


def test_values_reach_the_history_and_the_integrations(tmp_path: Path) -> None:
    """An integration listed before the callback (like report_to's) sees the values once the trainer is passed."""
    before, after = SeenInOnLog(), SeenInOnLog()
    trainer = Trainer(
        model=tiny_llama(0),
        args=make_args(tmp_path, max_steps=4, logging_steps=2, eval_strategy="steps", eval_steps=1),
        train_dataset=lm_dataset(8),
        eval_dataset=lm_dataset(2, seed=1),
        callbacks=[before, SlowEvaluation()],
    )
    throughput = ThroughputCallback(trainer, peak_flops=1e12)
    trainer.add_callback(throughput)
    trainer.add_callback(after)
    trainer.train()
    lines = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [KEYS <= entry.keys() for entry in lines] == [True, True]
    assert before.seen == after.seen == [KEYS, KEYS]
    window = throughput.last_window
    assert window["samples"] == 4 and window["tokens"] == 48  # 2 steps x 2 samples x 12 tokens
    shape = flops_shape(trainer.model)
    assert window["flops"] == 48 * training_flops_per_token(shape, 12)
    assert lines[-1]["samples_per_second"] == pytest.approx(4 / window["seconds"], rel=1e-3)
    assert lines[-1]["mfu"] == pytest.approx(window["flops"] / window["seconds"] / 1e12, rel=1e-3, abs=1e-5)
    counted, wall = 4 / lines[0]["samples_per_second"], before.times[1] - before.times[0]
    assert wall - counted > 0.95, "the 1 s evaluation inside the first window is not training time"


def test_no_mfu_on_cpu_without_a_peak(tmp_path: Path) -> None:
    trainer = Trainer(
        model=tiny_llama(0),
        args=make_args(tmp_path, max_steps=1),
        train_dataset=lm_dataset(2),
        callbacks=[ThroughputCallback()],
    )
    trainer.train()
    line = trainer.state.log_history[0]
    assert KEYS - line.keys() == {"mfu"}
    assert line["peak_memory_mib"] > 10  # max RSS of this process, in MiB


def test_flops_count_matrix_weights_once_and_no_lookups() -> None:
    model = tiny_llama(0)  # untied: lm_head is a matrix product, embed_tokens a lookup
    total = sum(p.numel() for p in model.parameters())
    assert matmul_params(model) == total - model.model.embed_tokens.weight.numel()
    model.config.tie_word_embeddings = True
    model.tie_weights()  # the table is now also the output head: counted, once
    assert matmul_params(model) == sum(p.numel() for p in model.parameters())
    params, layers, hidden = flops_shape(model)
    assert (layers, hidden) == (2, 32)
    assert training_flops_per_token((params, layers, hidden), 12) == 6 * params + 12 * 2 * 32 * 12
    assert flops_shape(torch.nn.Linear(3, 2)) == (8, 0, 0)


@pytest.mark.parametrize(
    ("name", "flops"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA A10G", None),
        ("Tesla T4", None),
    ],
)
def test_peak_flops_by_device_name(name: str, flops: float | None) -> None:
    assert lookup_peak_flops(name) == flops
