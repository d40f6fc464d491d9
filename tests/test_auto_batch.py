"""``--auto_find_batch_size``: an out-of-memory micro-batch runs again in chunks; the global batch stays.

The only stand-in is the out-of-memory error itself: hooks on real models raise ``torch.OutOfMemoryError`` when
a forward (or a backward) sees more rows than a limit. Every run is compared with a run started at the smaller
micro-batch and the larger accumulation, without the hooks.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from packaging.version import Version
from safetensors.torch import load_file
from torch import nn

from tests.distributed.auto_batch_job import JOBS, Memory, Regressor, Rows
from tests.helpers.device import use_cpu
from tests.helpers.ranks import run_ranks
from tests.helpers.tiny import pad_right, ragged_lm_dataset, tiny_llama
from trainer_ext import Trainer, TrainingArguments
from trainer_ext.errors import ConfigError

pytestmark = [pytest.mark.compat, pytest.mark.timeout(120)]

SHAPE_LINE = "auto_find_batch_size: out of memory at per-device batch"


def make_args(out: Path, **overrides: Any) -> TrainingArguments:
    base = dict(
        output_dir=str(out),
        use_cpu=use_cpu(),  # TRAINER_EXT_TEST_DEVICE (tests/helpers/device.py)
        report_to=[],
        num_train_epochs=2,
        learning_rate=5e-2,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    base.update(overrides)
    return TrainingArguments(**base)


def run(out: Path, model: nn.Module, dataset: Any, **args: Any) -> Trainer:
    extra = args.pop("trainer", {})
    trainer = Trainer(model=model, args=make_args(out, **args), train_dataset=dataset, **extra)
    trainer.train()
    return trainer


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}


def steps(trainer: Trainer) -> list[tuple[int, float, float]]:
    return [(h["step"], h["loss"], h["learning_rate"]) for h in trainer.state.log_history if "loss" in h]


def shape_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(SHAPE_LINE)]


@pytest.mark.parametrize(
    "limit,batch,accumulation",
    [(4, 4, 4), (3, 2, 8)],  # 8 -> 4 rows; 8 -> 4 -> 2 rows in one event
)
def test_oom_in_forward_keeps_the_global_batch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, limit: int, batch: int, accumulation: int
) -> None:
    memory = Memory(limit)
    with caplog.at_level(logging.WARNING):
        auto = run(
            tmp_path / "auto",
            memory.attach(Regressor(), Regressor().inner),
            Rows(),
            auto_find_batch_size=True,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=2,
        )
    reference = run(
        tmp_path / "ref",
        Regressor(),
        Rows(),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
    )
    assert memory.raised >= 1 and auto.state.global_step == reference.state.global_step == 4
    # chunks of equal size run the same kernels on the same rows in the same order: equal bit for bit on CPU
    for name, value in weights(reference).items():
        assert torch.equal(weights(auto)[name], value), name
    assert weights(reference)["outer.weight"].ne(Regressor().outer.weight).any(), "the weights must move"
    assert [s[0] for s in steps(auto)] == [s[0] for s in steps(reference)] == [1, 2, 3, 4]
    for (_, loss, lr), (_, ref_loss, ref_lr) in zip(steps(auto), steps(reference), strict=True):
        assert lr == ref_lr
        assert loss == pytest.approx(ref_loss, abs=1e-4)  # logged losses are rounded to 4 decimals
    assert shape_lines(caplog) == [
        f"{SHAPE_LINE} 8; continuing with {batch} per micro-batch x {accumulation} accumulation steps "
        "(global batch 16 unchanged)"
    ]
    assert auto._train_batch_size == 8 and auto.state.train_batch_size == batch


def test_oom_in_backward_mid_window_gives_exact_weights(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The second micro-batch of the first window fails in backward, after part of its gradients accumulated."""
    model = Regressor()
    memory = Memory(4, in_backward=True, after=1)
    with caplog.at_level(logging.WARNING):
        auto = run(
            tmp_path / "auto",
            memory.attach(model, model.inner),
            Rows(),
            auto_find_batch_size=True,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=2,
        )
    reference = run(
        tmp_path / "ref", Regressor(), Rows(), per_device_train_batch_size=4, gradient_accumulation_steps=4
    )
    assert memory.raised == 1 and memory.forwards > 2
    for name, value in weights(reference).items():
        assert torch.equal(weights(auto)[name], value), name
    # the first micro-batch's loss was counted before the error, at 8 rows: equal up to rounding
    for (step, loss, lr), (ref_step, ref_loss, ref_lr) in zip(steps(auto), steps(reference), strict=True):
        assert (step, lr) == (ref_step, ref_lr) and loss == pytest.approx(ref_loss, abs=1e-4)
    assert len(shape_lines(caplog)) == 1


def test_token_count_loss_of_a_causal_lm(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """tiny_llama normalises by ``num_items_in_batch`` over the window: chunks add up with no extra factor."""
    model = tiny_llama(0)
    memory = Memory(2)
    options = dict(
        trainer={"data_collator": pad_right},
        remove_unused_columns=False,
        learning_rate=1e-2,
    )
    with caplog.at_level(logging.WARNING):
        auto = run(
            tmp_path / "auto",
            memory.attach(model, model.model.layers[0]),
            ragged_lm_dataset(16),
            auto_find_batch_size=True,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            **options,
        )
    assert auto.model_accepts_loss_kwargs, "the token-count path must be the one under test"
    reference = run(
        tmp_path / "ref",
        tiny_llama(0),
        ragged_lm_dataset(16),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        **options,
    )
    assert memory.raised == 1 and auto.state.global_step == reference.state.global_step == 4
    # the 4-row batches are padded to their longest row, the reference's 2-row ones to theirs: not bitwise (the
    # reductions differ with the shapes and the thread count: 3.7e-6 apart on one thread, an Adam step is 1e-2)
    for name, value in weights(reference).items():
        torch.testing.assert_close(weights(auto)[name], value, rtol=1e-5, atol=1e-5, msg=name)
    for (step, loss, lr), (ref_step, ref_loss, ref_lr) in zip(steps(auto), steps(reference), strict=True):
        assert (step, lr) == (ref_step, ref_lr) and loss == pytest.approx(ref_loss, abs=1e-4)
    assert len(shape_lines(caplog)) == 1


def test_oom_at_one_row_is_a_clear_error(tmp_path: Path) -> None:
    model = Regressor()
    memory = Memory(0)
    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero") as raised:
        run(
            tmp_path,
            memory.attach(model, model.inner),
            Rows(),
            auto_find_batch_size=True,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=2,
        )
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)
    assert memory.raised == 4  # 8, 4, 2 and 1 rows


def test_without_the_flag_an_oom_is_raised_unchanged(tmp_path: Path) -> None:
    model = Regressor()
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        run(tmp_path, Memory(4).attach(model, model.inner), Rows(), per_device_train_batch_size=8)


def test_resume_after_the_shrink_keeps_the_global_batch(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    options = dict(
        auto_find_batch_size=True, per_device_train_batch_size=8, gradient_accumulation_steps=2, save_steps=2
    )
    first = Regressor()
    full = run(tmp_path / "full", Memory(4).attach(first, first.inner), Rows(), save_strategy="steps", **options)
    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["train_batch_size"] == 4
    model = Regressor()
    memory = Memory(4)
    args = make_args(tmp_path / "resumed", save_strategy="steps", **options)
    resumed = Trainer(model=memory.attach(model, model.inner), args=args, train_dataset=Rows())
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert memory.raised == 0 and shape_lines(caplog) == [], "the resumed run starts at the saved chunk size"
    assert resumed._train_batch_size == 8 and resumed.state.global_step == full.state.global_step == 4
    assert steps(resumed)[-2:] == steps(full)[-2:]
    for name, value in weights(full).items():
        assert torch.equal(weights(resumed)[name], value), name


def test_an_evaluation_oom_names_the_eval_batch(tmp_path: Path) -> None:
    """transformers 5.23's behaviour: the train chunk does not shrink for an evaluation error."""

    def no_memory_in_eval(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not module.training:
            raise torch.OutOfMemoryError("simulated: out of memory in evaluation")

    model = Regressor()
    model.register_forward_pre_hook(no_memory_in_eval, with_kwargs=True)
    args = make_args(tmp_path, auto_find_batch_size=True, per_device_train_batch_size=8, eval_strategy="steps")
    trainer = Trainer(model=model, args=args, train_dataset=Rows(), eval_dataset=Rows(8))
    if Version(transformers.__version__) < Version("5.23.0"):
        pytest.skip("transformers < 5.23 re-raises the evaluation error as it is")
    with pytest.raises(RuntimeError, match="reduce `per_device_eval_batch_size`"):
        trainer.train()


@pytest.mark.parametrize(
    "flags,match",
    [
        pytest.param(
            {"deepspeed": {"zero_optimization": {"stage": 2}}},
            "not supported with --deepspeed",
            marks=pytest.mark.deepspeed,  # without deepspeed, --deepspeed is refused before this check
        ),
        ({"fsdp": "full_shard"}, "not supported with --fsdp .each FSDP forward all-gathers"),
    ],
)
def test_deepspeed_and_fsdp_are_refused(tmp_path: Path, flags: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_args(tmp_path, auto_find_batch_size=True, **flags)


def test_find_executable_batch_size_runs_our_loop_once(tmp_path: Path) -> None:
    """transformers' ``train()`` asks accelerate for a restarting wrapper; ours gets its loop, called once."""
    import transformers.trainer as hf_trainer

    from trainer_ext.trainer import compat as _compat

    trainer = Trainer(model=Regressor(), args=make_args(tmp_path, auto_find_batch_size=True))
    with _compat.training_loop_names():  # what train() opens around transformers' loop
        find = hf_trainer.find_executable_batch_size
    wrapped = find(trainer._inner_training_loop, 8, True)
    assert wrapped.func == trainer._inner_training_loop and wrapped.keywords == {"batch_size": 8}

    def loop(batch_size: int) -> int:
        return batch_size

    assert find(loop, 3, False)() == 3  # anything else: transformers' own behaviour
    assert find(starting_batch_size=5)(loop)() == 5


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_ranks_shrink_independently(tmp_path: Path) -> None:
    """Only rank 0 runs out of memory, so the ranks run different numbers of chunks: only the last chunk of a
    window syncs and DDP's buffer broadcast is not repeated, so the collectives stay matched.

    2 ranks x batch 8 x accumulation A == 1 rank x batch 16 x accumulation A (tolerance 1e-6: the all-reduce
    averages in another order).
    """
    run_ranks("tests.distributed.auto_batch_job", 2, str(tmp_path))
    counts = json.loads((tmp_path / "results.json").read_text())
    for job, (_, accumulation, _) in JOBS.items():
        reference = weights(
            run(
                tmp_path / f"ref_{job}",
                Regressor(),
                Rows(64),
                per_device_train_batch_size=16,
                gradient_accumulation_steps=accumulation,
            )
        )
        assert counts[job][0] >= 1 and counts[job][1] == 0, counts
        two_ranks = load_file(str(tmp_path / f"{job}.safetensors"))
        for name, value in reference.items():
            torch.testing.assert_close(two_ranks[name], value, rtol=0, atol=1e-6, msg=f"{job}: {name}")
