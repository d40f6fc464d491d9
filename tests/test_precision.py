"""Precision and gradient accumulation through the Trainer: parity, step semantics, combination rules."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, TrainerCallback

from tests.helpers import jobs
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer, TrainingArguments
from trainer_ext.callbacks.run_summary import run_summary
from trainer_ext.distributed.precision import Precision, upcast_half_trainable
from trainer_ext.errors import ConfigError

pytestmark = pytest.mark.timeout(300)


@pytest.mark.compat
def test_accumulation_equals_one_big_batch_on_ragged_batches(tmp_path: Path) -> None:
    """1 rank x micro-batch 2 x accumulation 4 == 1 rank x batch 8: same gradients, losses and weights.

    Plain SGD, no clipping: a constant factor on the accumulated gradient (say the loss x3) moves the
    first step's gradients by 2x their size (~0.1) and fails every bound below; measured errors are ~1e-7.
    """
    big = jobs.accumulation_parity_job(tmp_path / "big", per_device_batch=8, grad_accum=1)
    acc = jobs.accumulation_parity_job(tmp_path / "acc", per_device_batch=2, grad_accum=4)
    jobs.assert_fp32_parity(acc, big)
    assert acc.info["scheduler_steps"] == 12, "the LR schedule counts optimizer steps, not micro-batches"


class LastWindow(TrainerCallback):
    """Records every micro-batch's input ids, and the weights and gradients the last optimizer step sees."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.batches: list[torch.Tensor] = []
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        self.batches.append(kwargs["input_ids"].detach().clone())

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.gradients = {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_shorter_last_window_is_normalised_by_its_own_tokens(tmp_path: Path) -> None:
    """10 micro-batches per epoch with accumulation 4: windows of 4, 4, 2; the last is not over-weighted.

    Its logged loss and its gradient must be those of one forward over its own 2 micro-batches (the
    token mean over its 4 sequences), recomputed here from the weights the step started from.
    """
    model = tiny_llama(0)
    recorder = LastWindow(model)
    args = jobs.make_args(
        tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=4, num_train_epochs=1, max_grad_norm=0.0
    )
    trainer = Trainer(model=model, args=args, train_dataset=lm_dataset(20), callbacks=[recorder])
    trainer.train()
    assert trainer.state.global_step == 3 and len(recorder.batches) == 10
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]

    reference = tiny_llama(0).to(trainer.args.device)
    reference.load_state_dict(recorder.weights)
    window = torch.cat(recorder.batches[-2:])
    assert window.shape == (4, 12)
    expected = reference(input_ids=window, labels=window).loss  # mean over the window's 4 x 11 targets
    expected.backward()
    assert abs(losses[-1] - expected.item()) < 1e-5, (losses, expected.item())
    grad_error = max(float((p.grad - recorder.gradients[n]).abs().max()) for n, p in reference.named_parameters())
    assert grad_error < 1e-6, grad_error
    assert max(float(p.grad.abs().max()) for p in reference.parameters()) > 1e-2


def test_classifier_whose_loss_ignores_num_items_is_averaged(tmp_path: Path, caplog) -> None:
    """BERT's classification head returns a mean loss: it must not be summed over the accumulation window."""
    config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_labels=2
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    data = lm_dataset(16).map(lambda row, i: {"labels": i % 2}, with_indices=True)
    args = jobs.make_args(tmp_path, gradient_accumulation_steps=4, max_steps=1, learning_rate=1e-12, logging_steps=1)
    with caplog.at_level(logging.INFO):
        trainer = Trainer(model=model, args=args, train_dataset=data)
    assert trainer.model_accepts_loss_kwargs is False
    trainer.train()
    assert abs(trainer.state.log_history[0]["loss"] - math.log(2)) < 0.2  # 4 x ln 2 without the fix

    llama_trainer = Trainer(model=tiny_llama(0), args=args, train_dataset=lm_dataset(8))
    assert llama_trainer.model_accepts_loss_kwargs is True


def test_start_up_block_is_printed_once(tmp_path: Path, capsys) -> None:
    args = jobs.make_args(
        tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=3, max_steps=2, run_summary=True
    )
    Trainer(model=tiny_llama(0), args=args, train_dataset=lm_dataset(14)).train()
    out = capsys.readouterr().out
    assert out.count("trainer_ext: one optimizer step") == 1
    assert "global batch (samples)  = 6 = 1 x 2 x 3" in out
    assert "global batch (tokens)   = 72" in out  # 6 samples x 12 tokens, all of one length
    assert "optimizer steps / epoch = 3 (the last window of each epoch has 1 micro-batches)" in out
    assert "optimizer steps, total  = 2" in out


def test_run_summary_states_the_step_semantics() -> None:
    text = run_summary(
        world_size=8,
        per_device_batch=4,
        accumulation=2,
        batches_per_epoch=100,
        max_steps=150,
        precision="bf16",
        strategy="ddp",
        schedule="cosine with 10 warm-up steps",
        tokens=(512.0, True),
    )
    assert "global batch (samples)  = 64 = 8 x 4 x 2" in text
    assert "global batch (tokens)   = 32768" in text
    assert "optimizer steps / epoch = 50\n" in text
    assert "counted in optimizer steps" in text


@pytest.mark.parametrize(
    "flags,match",
    [
        ({"fp16": True}, "CUDA"),
        ({"fp16": True, "bf16": True}, "fp16 and bf16|--fp16 and --bf16"),
        ({"fp8": True}, "fp8 training needs a CUDA GPU"),
        ({"fp8": True, "bf16": True}, "drop --fp16/--bf16"),
    ],
)
def test_precision_combination_rules(tmp_path: Path, flags: dict, match: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("these rules are about a machine without CUDA")
    with pytest.raises(ConfigError, match=match):
        TrainingArguments(output_dir=str(tmp_path), **flags)


def test_fp16_amp_upcasts_fp16_trainable_weights(caplog) -> None:
    """The 'Attempting to unscale FP16 gradients' trap: trainable fp16 weights become fp32, frozen stay fp16."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).half()
    model[0].weight.requires_grad_(False)
    param = model[1].weight
    optimizer = torch.optim.SGD([param], lr=0.1)
    with caplog.at_level(logging.WARNING):
        names = upcast_half_trainable(model)
    assert "1.weight" in names and "0.weight" not in names
    assert model[1].weight is param and param.dtype == torch.float32, "same Parameter: the optimizer keeps it"
    assert optimizer.param_groups[0]["params"][0].dtype == torch.float32
    assert model[0].weight.dtype == torch.float16
    assert "upcast" in caplog.text


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled")
def test_fp16_precision_prepares_trainable_weights_for_the_scaler() -> None:
    model = torch.nn.Linear(4, 4).half()
    Precision("fp16", torch.device("cuda")).prepare_for_training(model)
    assert model.weight.dtype == torch.float32
    bf16_model = torch.nn.Linear(4, 4).half()
    Precision("bf16", torch.device("cpu")).prepare_for_training(bf16_model)  # no scaler: nothing to fix
    assert bf16_model.weight.dtype == torch.float16
    assert Precision("fp8", torch.device("cpu")).dtype == torch.bfloat16  # autocast dtype around float8 layers
