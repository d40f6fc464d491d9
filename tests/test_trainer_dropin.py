"""Ordinary transformers scripts that broke on trainer_ext.Trainer (issue 14), each as it was seen, now working."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset
from transformers import HfArgumentParser, TrainerCallback
from transformers.trainer_pt_utils import AcceleratorConfig

from trainer_ext import Trainer, TrainingArguments


class Regression(nn.Module):
    """A research-style model: no PreTrainedModel, ``self.config = None``, a dict with the loss."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.config = None
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.linear(x).squeeze(-1)
        loss = nn.functional.mse_loss(out, labels) if labels is not None else None
        return {"loss": loss, "logits": out}


def _rows(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(n, 4, generator=g)
    return [{"x": x, "labels": x.sum() * 0.5 + 0.1} for x in xs]


class Rows(Dataset):
    def __init__(self, n: int) -> None:
        self.rows = _rows(n)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        yield from _rows(self.n)


def _args(out: Path, **overrides) -> TrainingArguments:
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=0.05,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    base.update(overrides)
    return TrainingArguments(**base)


def test_a_model_whose_config_is_none_trains_and_checkpoints(tmp_path: Path) -> None:
    trainer = Trainer(model=Regression(), args=_args(tmp_path, max_steps=4, save_steps=2), train_dataset=Rows(32))
    trainer.train()
    assert (tmp_path / "checkpoint-2" / "model.safetensors").is_file()
    assert (tmp_path / "checkpoint-4" / "model.safetensors").is_file()
    assert not (tmp_path / "checkpoint-4" / "config.json").exists()  # as transformers: it has no config


def test_training_on_an_iterable_dataset(tmp_path: Path) -> None:
    args = _args(tmp_path, max_steps=5, save_strategy="no", run_summary=True)
    trainer = Trainer(model=Regression(), args=args, train_dataset=Stream(40))
    assert trainer.train().global_step == 5


def test_a_custom_train_dataloader_without_a_dataset_attribute(tmp_path: Path) -> None:
    class Batches:
        """A loader that is just an iterable of batches with a length (no ``.dataset``)."""

        def __init__(self) -> None:
            self.inner = DataLoader(Rows(32), batch_size=4)

        def __iter__(self):
            return iter(self.inner)

        def __len__(self) -> int:
            return len(self.inner)

    class Custom(Trainer):
        def get_train_dataloader(self):
            return Batches()

    args = _args(tmp_path, max_steps=3, save_strategy="no", run_summary=True)
    trainer = Custom(model=Regression(), args=args, train_dataset=Rows(32))
    assert trainer.train().global_step == 3


def test_memory_metrics_are_reported_without_accelerate(tmp_path: Path) -> None:
    pytest.importorskip("psutil", reason="psutil is a dependency of trainer_ext: pip install -e .")
    args = _args(tmp_path, max_steps=2, save_strategy="no", skip_memory_metrics=False)
    metrics = Trainer(model=Regression(), args=args, train_dataset=Rows(16)).train().metrics
    assert "train_mem_cpu_alloc_delta" in metrics and "train_mem_cpu_peaked_delta" in metrics


def test_psutil_is_an_install_requirement() -> None:
    setup = (Path(__file__).resolve().parent.parent / "setup.cfg").read_text()
    requires = setup.split("install_requires =", 1)[1].split("\n\n", 1)[0]
    assert "psutil" in requires


# --- resume_from_checkpoint as scripts pass it ---------------------------------------------------------------


def _checkpointed(out: Path) -> None:
    Trainer(model=Regression(), args=_args(out, max_steps=4, save_steps=2), train_dataset=Rows(32)).train()


@pytest.mark.parametrize("word", ["true", "True", "TRUE", "latest", "Latest", "auto", "AUTO"])
def test_resume_words_from_hfargumentparser_mean_the_newest_checkpoint(tmp_path: Path, word: str) -> None:
    _checkpointed(tmp_path)
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none", "--max_steps", "6", "--save_steps", "2"]
        + ["--resume_from_checkpoint", word, "--per_device_train_batch_size", "4", "--logging_steps", "1"]
    )
    assert args.resume_from_checkpoint == word  # the parser leaves it a string
    steps: list[int] = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    trainer = Trainer(model=Regression(), args=args, train_dataset=Rows(32), callbacks=[Steps()])
    assert trainer.resolve_resume(args.resume_from_checkpoint) == str(tmp_path / "checkpoint-4")
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    assert steps == [5, 6]  # the run went on after checkpoint-4, it did not start over


def test_resuming_with_no_checkpoint_keeps_transformers_error(tmp_path: Path) -> None:
    trainer = Trainer(model=Regression(), args=_args(tmp_path, max_steps=2), train_dataset=Rows(16))
    for value in (True, "true", "latest"):
        with pytest.raises(ValueError, match=r"^No valid checkpoint found in output directory") as caught:
            trainer.train(resume_from_checkpoint=value)
        assert str(tmp_path) in str(caught.value) and "auto" in str(caught.value)  # our detail follows


def test_resuming_from_a_path_that_does_not_exist_is_one_clear_error(tmp_path: Path) -> None:
    trainer = Trainer(model=Regression(), args=_args(tmp_path, max_steps=2), train_dataset=Rows(16))
    missing = tmp_path / "checkpoint-99"
    with pytest.raises(ValueError, match=r"^Can't find a valid checkpoint at .*checkpoint-99: no such directory"):
        trainer.train(resume_from_checkpoint=str(missing))
    assert not any(tmp_path.iterdir())  # nothing was written


def test_resume_auto_with_no_checkpoint_starts_fresh(tmp_path: Path) -> None:
    trainer = Trainer(
        model=Regression(), args=_args(tmp_path, max_steps=2, save_strategy="no"), train_dataset=Rows(16)
    )
    assert trainer.train(resume_from_checkpoint="auto").global_step == 2


class Histogram(Regression):
    """A model whose own ``load_state_dict`` resizes a buffer to what the checkpoint holds (legitimately)."""

    def __init__(self, bins: int = 2) -> None:
        super().__init__()
        self.register_buffer("counts", torch.zeros(bins))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        self.counts = torch.zeros_like(state_dict["counts"])
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


class GrowCounts(TrainerCallback):
    def on_step_end(self, args, state, control, model=None, **kwargs):
        model.counts = torch.zeros(model.counts.numel() + 1)


def test_a_model_that_resizes_its_own_buffers_resumes(tmp_path: Path) -> None:
    args = _args(tmp_path, max_steps=4, save_steps=2)
    Trainer(model=Histogram(), args=args, train_dataset=Rows(32), callbacks=[GrowCounts()]).train()
    trainer = Trainer(model=Histogram(), args=_args(tmp_path, max_steps=6, save_steps=2), train_dataset=Rows(32))
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 6 and trainer.model.counts.numel() == 6  # 2 bins + 1 per step, at step 4


def test_a_checkpoint_of_another_model_is_still_refused(tmp_path: Path) -> None:
    _checkpointed(tmp_path)

    class Wider(Regression):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, x, labels=None):
            return super().forward(x, labels)

    trainer = Trainer(model=Wider(), args=_args(tmp_path, max_steps=6), train_dataset=Rows(32))
    with pytest.raises(ValueError, match="holds another model: shapes differ: linear.bias"):
        trainer.train(resume_from_checkpoint=True)


# --- accelerator_config as transformers reads it -------------------------------------------------------------


def test_accelerator_config_becomes_transformers_dataclass(tmp_path: Path) -> None:
    args = _args(tmp_path, accelerator_config={"even_batches": False})
    assert isinstance(args.accelerator_config, AcceleratorConfig)
    assert args.accelerator_config.even_batches is False
    assert json.loads(args.to_json_string())["accelerator_config"]["even_batches"] is False


def test_an_uninstantiated_accelerator_config_class_is_transformers_error(tmp_path: Path) -> None:
    with pytest.raises(NotImplementedError, match="Tried passing in a callable to `accelerator_config`"):
        _args(tmp_path, accelerator_config=AcceleratorConfig)


def test_the_engine_exposes_what_transformers_reads(tmp_path: Path) -> None:
    config = {"split_batches": True, "even_batches": False, "gradient_accumulation_kwargs": {"sync_each_batch": True}}
    trainer = Trainer(model=Regression(), args=_args(tmp_path, accelerator_config=config), train_dataset=Rows(8))
    engine = trainer.accelerator
    assert engine.split_batches is True and engine.even_batches is False
    assert engine.gradient_state.plugin_kwargs == {"num_steps": 1, "sync_each_batch": True}


def test_num_steps_in_the_accelerator_config_sets_the_accumulation(tmp_path: Path) -> None:
    config = {"gradient_accumulation_kwargs": {"num_steps": 3}}
    trainer = Trainer(model=Regression(), args=_args(tmp_path, accelerator_config=config), train_dataset=Rows(8))
    assert trainer.args.gradient_accumulation_steps == 3
    assert trainer.accelerator.gradient_state.plugin_kwargs == {"num_steps": 1}
    both = _args(tmp_path, accelerator_config=config, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match=r"^The `AcceleratorConfig`'s `num_steps` is set"):
        Trainer(model=Regression(), args=both, train_dataset=Rows(8))


def test_the_run_summary_handles_iterable_data(caplog, capsys, tmp_path: Path) -> None:
    args = _args(tmp_path, max_steps=2, save_strategy="no", run_summary=True)
    with caplog.at_level(logging.WARNING):
        Trainer(model=Regression(), args=args, train_dataset=Stream(16)).train()
    assert "optimizer steps / epoch = unknown (the data has no length)" in capsys.readouterr().out


def test_resume_true_takes_a_run_written_without_trainer_ext(tmp_path: Path) -> None:
    """No checkpoint has a COMPLETE marker (plain transformers wrote them): the newest finished one is taken."""
    Trainer(model=Regression(), args=_args(tmp_path, max_steps=6, save_steps=2), train_dataset=Rows(32)).train()
    for marker in tmp_path.glob("checkpoint-*/COMPLETE"):
        marker.unlink()
    (tmp_path / "checkpoint-6" / "trainer_state.json").unlink()  # killed before transformers finished it
    trainer = Trainer(model=Regression(), args=_args(tmp_path, max_steps=8, save_steps=2), train_dataset=Rows(32))
    assert trainer.resolve_resume(True) == str(tmp_path / "checkpoint-4")
    assert trainer.train(resume_from_checkpoint=True).global_step == 8


def test_where_markers_exist_a_folder_without_one_is_not_resumed(tmp_path: Path) -> None:
    Trainer(model=Regression(), args=_args(tmp_path, max_steps=6, save_steps=2), train_dataset=Rows(32)).train()
    (tmp_path / "checkpoint-6" / "COMPLETE").unlink()  # as if killed while committing checkpoint-6
    trainer = Trainer(model=Regression(), args=_args(tmp_path, max_steps=8, save_steps=2), train_dataset=Rows(32))
    assert trainer.resolve_resume("latest") == str(tmp_path / "checkpoint-4")
