"""UnwrapAndSaveCallback on one process: checked checkpoints, a final model that reloads, and clear mismatches."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback

from tests.callbacks.callbacks_ranks import tiny_tokenizer
from tests.helpers.jobs import make_args
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.callbacks import SavedModelMismatchError, UnwrapAndSaveCallback
from trainer_ext.callbacks.unwrap_and_save import save_unwrapped, verify_saved_model
from trainer_ext.distributed.engine import Engine
from trainer_ext.distributed.state import DistState


def _keys(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def test_checkpoints_are_checked_and_the_final_model_reloads(tmp_path: Path) -> None:
    trainer = Trainer(
        model=tiny_llama(0),
        args=make_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2),
        train_dataset=lm_dataset(8),
        processing_class=tiny_tokenizer(),
    )
    saver = UnwrapAndSaveCallback(trainer)
    trainer.add_callback(saver)
    trainer.train()
    assert saver.verified == [str(tmp_path / "checkpoint-2"), str(tmp_path / "checkpoint-4"), str(tmp_path)]
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    model = trainer.model.eval()
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert PreTrainedTokenizerFast.from_pretrained(tmp_path).convert_tokens_to_ids("t5") == 5


class CorruptCheckpoint(TrainerCallback):
    """Drops one tensor from the checkpoint the Trainer has just written (placed before the checking callback)."""

    def on_save(self, args, state, control, **kwargs):
        path = Path(args.output_dir) / f"checkpoint-{state.global_step}" / "model.safetensors"
        tensors = load_file(str(path))
        del tensors["model.norm.weight"]
        save_file(tensors, str(path), metadata={"format": "pt"})


def test_a_broken_checkpoint_stops_training_with_the_missing_name(tmp_path: Path) -> None:
    trainer = Trainer(
        model=tiny_llama(0),
        args=make_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=1),
        train_dataset=lm_dataset(4),
        callbacks=[CorruptCheckpoint(), UnwrapAndSaveCallback()],  # without the trainer: the model callbacks get
    )
    with pytest.raises(SavedModelMismatchError, match=r"checkpoint-1 .*missing tensors: model\.norm\.weight"):
        trainer.train()
    assert trainer.state.global_step == 1


def test_wrong_shapes_and_unexpected_names_are_reported(tmp_path: Path) -> None:
    model = tiny_llama(0)
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(7)
    tensors["extra.weight"] = torch.ones(2)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SavedModelMismatchError) as error:
        verify_saved_model(model, tmp_path)
    assert "unknown tensors: extra.weight" in str(error.value)
    assert "shapes differ: model.norm.weight [7] vs [32]" in str(error.value)


def test_tied_weights_that_save_pretrained_drops_are_accepted(tmp_path: Path) -> None:
    model = tiny_llama(0)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    save_unwrapped(model, tmp_path)
    assert "lm_head.weight" not in _keys(tmp_path / "model.safetensors")
    verify_saved_model(model, tmp_path)
    untied = tiny_llama(0)  # same names, but lm_head is its own weight: its absence is a real loss
    with pytest.raises(SavedModelMismatchError, match=r"missing tensors: lm_head\.weight"):
        verify_saved_model(untied, tmp_path)


class _EngineTrainer:
    """The parts of a Trainer the callback reads, around a model the test wraps itself."""

    def __init__(self, model_wrapped: torch.nn.Module, processing_class=None) -> None:
        self.accelerator = Engine(DistState(cpu=True, init=False))
        self.model_wrapped = model_wrapped
        self.processing_class = processing_class


@pytest.mark.parametrize("through", ["engine", "callback argument"])
def test_a_compiled_plain_module_is_unwrapped_before_saving(tmp_path: Path, through: str) -> None:
    """``torch.compile`` wrapper and a shared weight: the file holds the module's own names, one copy of the weight."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    net[2].weight = net[0].weight
    compiled = torch.compile(net, backend="eager")
    if through == "engine":
        trainer = _EngineTrainer(compiled)
        saver = UnwrapAndSaveCallback(trainer)
    else:
        saver = UnwrapAndSaveCallback()
    saver.on_train_end(SimpleNamespace(should_save=True, output_dir=str(tmp_path)), None, None, model=compiled)
    assert saver.verified == [str(tmp_path)]
    keys = _keys(tmp_path / "model.safetensors")
    assert not any("_orig_mod" in k for k in keys)
    assert len(keys & {"0.weight", "2.weight"}) == 1 and {"0.bias", "2.bias"} <= keys


def test_weights_that_transformers_renames_on_save_are_expected_under_their_saved_names(tmp_path: Path) -> None:
    """transformers 5 saves Mixtral's fused experts back in the hub layout (other names, other shapes)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=2,
    )
    model = MixtralForCausalLM(config)
    model.save_pretrained(tmp_path)
    saved = _keys(tmp_path / "model.safetensors")
    assert saved != set(model.state_dict()), "the conversion must change names for this test to mean anything"
    verify_saved_model(model, tmp_path)
