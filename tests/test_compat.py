"""The transformers internals trainer_ext relies on: fail loudly when a supported version changes them."""

from __future__ import annotations

import functools
import inspect

import pytest
import transformers
import transformers.trainer as hf_trainer
import transformers.training_args as hf_args

from trainer_ext import _compat
from trainer_ext.dist.accumulation import GradientState
from trainer_ext.dist.data import ShardedDataLoader, shard_dataloader

pytestmark = pytest.mark.compat


@pytest.mark.parametrize("version", ["5.17.0", "5.20.1", "5.23.0", "5.23.1.dev0"])
def test_supported_versions_pass(version: str) -> None:
    _compat.check_transformers_version(version)


@pytest.mark.parametrize("version", ["4.57.1", "5.16.1", "5.24.0", "6.0.0"])
def test_unsupported_versions_fail_loudly(version: str) -> None:
    with pytest.raises(ImportError, match=r"supports transformers >=5\.17\.0,<5\.24\.0"):
        _compat.check_transformers_version(version)


def test_installed_transformers_is_supported() -> None:
    _compat.check_transformers_version(transformers.__version__)


def _names_used(function) -> set[str]:
    return set(inspect.unwrap(function).__code__.co_names)


def test_the_names_we_provide_are_the_names_the_trainer_reads() -> None:
    """If transformers renames these globals, our injection silently stops working: catch it here."""
    _compat.install()
    assert "DistributedType" in _names_used(transformers.Trainer._run_epoch)
    assert "skip_first_batches" in _names_used(transformers.Trainer._run_epoch)
    assert "DistributedType" in _names_used(transformers.Trainer.training_step)
    assert "clear_device_cache" in _names_used(transformers.Trainer.training_step)
    assert "DistributedType" in _names_used(transformers.Trainer._get_grad_norm)
    assert "release_memory" in _names_used(transformers.Trainer._update_auto_batch_size)
    for name in ("DistributedType", "skip_first_batches", "clear_device_cache", "release_memory"):
        assert hasattr(hf_trainer, name), name
    assert hasattr(hf_args, "DistributedType")


def test_the_doors_we_override_exist() -> None:
    assert isinstance(
        inspect.getattr_static(transformers.TrainingArguments, "_setup_devices"), functools.cached_property
    )
    assert isinstance(inspect.getattr_static(transformers.TrainingArguments, "parallel_mode"), property)
    assert callable(transformers.Trainer.create_accelerator_and_postprocess)
    source = inspect.getsource(transformers.Trainer.__init__)
    assert "create_accelerator_and_postprocess" in source
    assert "is_deepspeed_enabled" in source and "is_fsdp_enabled" in source


def test_install_is_idempotent_and_routes_skip_first_batches() -> None:
    _compat.install()
    first = hf_trainer.skip_first_batches
    _compat.install()
    assert hf_trainer.skip_first_batches is first
    from torch.utils.data import DataLoader

    loader = shard_dataloader(
        DataLoader(list(range(10)), batch_size=2),
        num_processes=1,
        process_index=0,
        gradient_state=GradientState(),
        seed=0,
    )
    skipped = hf_trainer.skip_first_batches(loader, 2)
    assert isinstance(skipped, ShardedDataLoader)
    assert [b.tolist() for b in skipped] == [[4, 5], [6, 7], [8, 9]]


def test_accelerator_config_is_converted_without_accelerate() -> None:
    from transformers.trainer_pt_utils import AcceleratorConfig

    assert isinstance(_compat.accelerator_config(None), AcceleratorConfig)
    config = _compat.accelerator_config({"even_batches": False})
    assert config.even_batches is False


def test_activation_checkpointing_rule_reads_both_spellings() -> None:
    class Old:
        is_gradient_checkpointing = True

    class Args:
        gradient_checkpointing = False

    assert _compat.uses_activation_checkpointing(Old(), Args())
    assert not _compat.uses_activation_checkpointing(object(), Args())


def test_the_checkpoint_internals_we_rely_on() -> None:
    """_save_checkpoint is the override point; rotation reads args.save_total_limit; RNG files need numpy globals."""
    assert callable(transformers.Trainer._save_checkpoint)
    assert "save_total_limit" in inspect.getsource(transformers.Trainer._save_checkpoint)
    assert "weights_only=True" in inspect.getsource(transformers.Trainer._load_rng_state)
    with _compat.numpy_rng_safe_globals():
        pass


def test_the_save_renaming_hook_exists() -> None:
    """UnwrapAndSaveCallback predicts saved names through transformers' weight-conversion reversal."""
    from transformers.core_model_loading import revert_weight_conversion

    assert callable(revert_weight_conversion)
