"""trainer_ext.Trainer with a real peft LoRA model: only the adapter trains, is saved, reloads and resumes."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("peft")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from tests.helpers.jobs import StopAt, make_args  # noqa: E402
from tests.helpers.tiny import lm_dataset, tiny_llama  # noqa: E402
from tests.with_peft.lora_models import (  # noqa: E402
    PeftModel,
    adapter_state,
    base_state,
    logits,
    lora_config,
    lora_llama,
    max_diff,
    needs_transformers_peft_integration,
)
from trainer_ext import Trainer  # noqa: E402
from trainer_ext.callbacks import SavedModelMismatchError, UnwrapAndSaveCallback  # noqa: E402
from trainer_ext.callbacks.unwrap_and_save import verify_saved_model  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ADAPTER_FILES = {"adapter_model.safetensors", "adapter_config.json"}


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file()}


def test_only_the_adapter_trains_and_every_save_is_the_adapter_that_reloads(tmp_path: Path) -> None:
    model = lora_llama(0)
    initial_adapter, initial_base = adapter_state(model), base_state(model)
    assert initial_base.keys() == tiny_llama(0).state_dict().keys()
    trainer = Trainer(
        model=model,
        args=make_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, save_final_model=True),
        train_dataset=lm_dataset(16),
    )
    saver = trainer.callback_handler.duty(UnwrapAndSaveCallback)
    trainer.train()
    trained = trainer.model
    assert all("lora_" in name for name, p in trained.named_parameters() if p.requires_grad)
    assert max_diff(base_state(trained), initial_base) == 0.0, "a frozen base weight changed"
    moved = adapter_state(trained)
    assert all(not torch.equal(moved[k], initial_adapter[k]) for k in moved), "every adapter tensor must train"

    # the default UnwrapAndSaveCallback checked both checkpoints and wrote, then checked, the final adapter
    assert saver.verified == [str(tmp_path / "checkpoint-2"), str(tmp_path / "checkpoint-4"), str(tmp_path)]
    for folder in (tmp_path, tmp_path / "checkpoint-4"):
        assert ADAPTER_FILES <= _files(folder) and "model.safetensors" not in _files(folder), folder
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert max_diff(saved, moved) == 0.0

    explicit = tmp_path / "explicit"
    trainer.save_model(str(explicit))
    assert ADAPTER_FILES <= _files(explicit) and "model.safetensors" not in _files(explicit)

    expected = logits(trained)
    assert float((expected - logits(tiny_llama(0))).abs().max()) > 1e-4, "the adapter must change the output"
    for folder in (tmp_path, explicit):
        reloaded = PeftModel.from_pretrained(tiny_llama(0), str(folder))
        torch.testing.assert_close(logits(reloaded), expected, rtol=0, atol=0)


def _resume_run(out: Path, stop: int | None = None, resume: str | None = None) -> Trainer:
    trainer = Trainer(
        model=lora_llama(0),
        args=make_args(out, per_device_train_batch_size=2, save_strategy="steps", save_steps=3, num_train_epochs=2),
        train_dataset=lm_dataset(12, seed=3),
        callbacks=[StopAt(stop)] if stop else None,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_a_lora_run_resumed_from_its_checkpoint_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """12 steps uninterrupted vs. stopped at step 3 (mid-epoch) and resumed: the adapters are bitwise equal."""
    full = _resume_run(tmp_path / "full")
    part = _resume_run(tmp_path / "part", stop=3)
    assert part.state.global_step == 3 and full.state.global_step == 12
    assert max_diff(adapter_state(part.model), adapter_state(full.model)) > 1e-3, "the stop must be mid-training"
    resumed = _resume_run(tmp_path / "part", resume=str(tmp_path / "part" / "checkpoint-3"))
    assert resumed.state.global_step == 12
    full_adapter, resumed_adapter = adapter_state(full.model), adapter_state(resumed.model)
    for name in full_adapter:
        assert torch.equal(full_adapter[name], resumed_adapter[name]), name


class DropAdapterTensor(TrainerCallback):
    """Removes one LoRA tensor from the checkpoint just written (placed before the checking callback)."""

    def on_save(self, args, state, control, **kwargs):
        path = Path(args.output_dir) / f"checkpoint-{state.global_step}" / "adapter_model.safetensors"
        tensors = load_file(str(path))
        self.dropped = sorted(tensors)[0]
        del tensors[self.dropped]
        save_file(tensors, str(path), metadata={"format": "pt"})


def test_a_checkpoint_missing_an_adapter_tensor_stops_training_with_its_name(tmp_path: Path) -> None:
    corrupt = DropAdapterTensor()
    trainer = Trainer(
        model=lora_llama(0),
        args=make_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=1),
        train_dataset=lm_dataset(4),
        callbacks=[corrupt, UnwrapAndSaveCallback()],
    )
    with pytest.raises(SavedModelMismatchError, match=r"checkpoint-1 .*missing tensors: "):
        trainer.train()
    assert corrupt.dropped.endswith("lora_A.weight") and trainer.state.global_step == 1


def test_every_adapter_is_saved_and_checked_in_its_own_folder(tmp_path: Path) -> None:
    """peft writes an adapter not named ``default`` (and each extra one) to a sub-folder of its name."""
    model = lora_llama(0, adapter_name="mine")
    model.add_adapter("second", lora_config())
    args = make_args(tmp_path, max_steps=2, save_final_model=True)
    trainer = Trainer(model=model, args=args, train_dataset=lm_dataset(4))
    trainer.train()
    for name in ("mine", "second"):
        assert ADAPTER_FILES <= _files(tmp_path / name), name
    reloaded = PeftModel.from_pretrained(tiny_llama(0), str(tmp_path / "mine"), adapter_name="mine")
    torch.testing.assert_close(logits(reloaded), logits(trainer.model), rtol=0, atol=0)
    (tmp_path / "second" / "adapter_model.safetensors").unlink()
    with pytest.raises(SavedModelMismatchError, match="second"):
        verify_saved_model(trainer.model, tmp_path)


@needs_transformers_peft_integration
def test_an_adapter_added_through_transformers_is_trained_saved_and_reloaded(tmp_path: Path) -> None:
    """``model.add_adapter(LoraConfig)`` (transformers' own peft integration): the model stays a PreTrainedModel."""
    model = tiny_llama(0)
    model.add_adapter(lora_config())
    assert model._hf_peft_config_loaded
    initial = {k: v.clone() for k, v in model.get_adapter_state_dict().items()}
    trainer = Trainer(
        model=model,
        args=make_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, save_final_model=True),
        train_dataset=lm_dataset(16),
    )
    trainer.train()
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)
    trained = model.get_adapter_state_dict()
    assert max_diff(trained, initial) > 1e-3
    for folder in (tmp_path, tmp_path / "checkpoint-4"):
        assert ADAPTER_FILES <= _files(folder) and "model.safetensors" not in _files(folder), folder
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))  # PEFT's format: under its wrapper's prefix
    assert max_diff(saved, {f"base_model.model.{k}": v for k, v in trained.items()}) == 0.0
    reloaded = tiny_llama(0)
    reloaded.load_adapter(str(tmp_path))
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)
