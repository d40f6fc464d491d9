"""The transformers internals trainer_ext relies on: fail loudly when a supported version changes them."""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import io
import logging
import pickle
import random
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
import transformers
import transformers.trainer as hf_trainer
import transformers.training_args as hf_args
from transformers import TrainerCallback

from trainer_ext import Trainer, TrainingArguments
from trainer_ext.distributed.accumulation import GradientState
from trainer_ext.distributed.data.loader import ShardedDataLoader, shard_dataloader
from trainer_ext.trainer import compat as _compat

pytestmark = pytest.mark.compat


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget whether this process already warned about a newer transformers."""
    monkeypatch.setattr(_compat, "_warned_newer", False)


@pytest.mark.parametrize("version", ["5.17.0", "5.20.1", "5.23.0", "5.23.1.dev0"])
def test_tested_versions_pass_silently(version: str, fresh_warning: None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.check_transformers_version(version)


@pytest.mark.parametrize("version", ["4.57.1", "5.5.4", "5.16.1", "5.0.0rc1"])
def test_versions_known_to_break_are_refused(version: str) -> None:
    with pytest.raises(ImportError, match=r"known broken: <5\.17; tested: >=5\.17\.0,<5\.25\.0\)") as error:
        _compat.check_transformers_version(version)
    assert "pip install 'transformers>=5.17.0,<5.25.0'" in str(error.value)


@pytest.mark.parametrize("version", ["5.25.0", "5.25.0.dev0", "5.30.1", "6.0.0"])
def test_newer_versions_warn_once_and_proceed(version: str, fresh_warning: None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _compat.check_transformers_version(version)
        _compat.check_transformers_version("5.23.0")
    assert len(caught) == 1 and caught[0].category is UserWarning
    message = str(caught[0].message)
    assert message.startswith(f"trainer_ext is tested with transformers >=5.17.0,<5.25.0; {version} is newer")
    assert "report" in message and "pip install 'transformers>=5.17.0,<5.25.0'" in message


def test_a_newer_transformers_warns_at_the_trainer_import_not_at_import_trainer_ext() -> None:
    """A fresh interpreter that believes transformers is 9.0.0: ``import trainer_ext`` is silent, the Trainer warns."""
    code = (
        "import warnings, transformers; transformers.__version__ = '9.0.0'; warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    import trainer_ext, trainer_ext.cli.main\n"
        "assert not caught, [str(w.message) for w in caught]\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    from trainer_ext import Trainer, TrainingArguments\n"
        "print(sum('is newer' in str(w.message) for w in caught))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


def test_installed_transformers_is_not_refused() -> None:
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


def _our_loader(n: int = 10) -> ShardedDataLoader:
    from torch.utils.data import DataLoader

    return shard_dataloader(
        DataLoader(list(range(n)), batch_size=2),
        num_processes=1,
        process_index=0,
        gradient_state=GradientState(),
        seed=0,
    )


# --- runtime patches (docs/runtime-patches.md): each kept one, why the drop-in needs it, and that it stays local ---


def test_install_sets_only_the_names_transformers_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Names accelerate bound (here stand-ins) are left alone; missing ones become ours; nothing else is replaced."""
    monkeypatch.setattr(_compat, "_installed", False)
    accelerate_like = {"skip_first_batches": lambda loader, n=0: loader, "release_memory": lambda *objects: []}
    for name in ("DistributedType", "clear_device_cache", "should_reduce_batch_size"):
        monkeypatch.delattr(hf_trainer, name, raising=False)
    for name, value in accelerate_like.items():
        monkeypatch.setattr(hf_trainer, name, value)
    monkeypatch.delattr(hf_args, "DistributedType", raising=False)
    stock_find = hf_trainer.find_executable_batch_size
    _compat.install()
    _compat.install()  # idempotent
    for name, value in accelerate_like.items():
        assert getattr(hf_trainer, name) is value, name
    assert hf_trainer.find_executable_batch_size is stock_find
    assert hf_trainer.DistributedType is hf_args.DistributedType is _compat.DistributedType
    assert hf_trainer.clear_device_cache is _compat.clear_device_cache
    assert hf_trainer.should_reduce_batch_size is _compat.should_reduce_batch_size


def test_without_accelerate_the_missing_skip_first_batches_is_ours() -> None:
    _compat.install()
    if importlib.util.find_spec("accelerate") is not None:
        pytest.skip("accelerate is installed: transformers binds its own skip_first_batches")
    skipped = hf_trainer.skip_first_batches(_our_loader(), 2)
    assert isinstance(skipped, ShardedDataLoader)
    assert [b.tolist() for b in skipped] == [[4, 5], [6, 7], [8, 9]]


def test_stock_find_executable_batch_size_needs_accelerate_for_auto_find_batch_size() -> None:
    """Why our loop needs its own name: transformers' one hands ``auto_find_batch_size`` to accelerate."""
    from transformers.trainer_utils import find_executable_batch_size

    if importlib.util.find_spec("accelerate") is not None:
        pytest.skip("accelerate is installed")
    assert find_executable_batch_size(lambda batch_size: batch_size, 8, False)() == 8
    with pytest.raises((ImportError, KeyError)):  # 5.24 fails formatting its "needs accelerate" message: KeyError
        find_executable_batch_size(lambda batch_size: batch_size, 8, True)


def test_loop_names_are_routed_only_while_the_loop_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With accelerate's ``skip_first_batches`` bound (a stand-in), ours skips our loaders, accelerate's the rest."""
    from torch.utils.data import DataLoader

    _compat.install()
    calls = []

    def accelerate_skip(loader, num_batches=0):  # noqa: ANN001, ANN202
        calls.append(num_batches)
        return loader

    monkeypatch.setattr(hf_trainer, "skip_first_batches", accelerate_skip)
    stock_find = hf_trainer.find_executable_batch_size
    with _compat.training_loop_names():
        with _compat.training_loop_names():  # nested (hyperparameter search, a callback that trains): one set-up
            routed = hf_trainer.skip_first_batches
        assert hf_trainer.skip_first_batches is routed and routed is not accelerate_skip
        assert [b.tolist() for b in routed(_our_loader(), 3)] == [[6, 7], [8, 9]]
        plain = DataLoader(list(range(4)), batch_size=2)
        assert routed(plain, 1) is plain and calls == [1]
        assert hf_trainer.find_executable_batch_size is not stock_find
    assert hf_trainer.skip_first_batches is accelerate_skip
    assert hf_trainer.find_executable_batch_size is stock_find


class _LoopNames(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self.find = hf_trainer.find_executable_batch_size


@pytest.mark.parametrize("auto_find_batch_size", [False, True])
def test_our_trainer_trains_on_its_loop_names_and_puts_them_back(tmp_path, auto_find_batch_size: bool) -> None:
    from tests.test_trainer_dropin import Regression, Rows
    from tests.test_trainer_dropin import _args as dropin_args

    stock_find = hf_trainer.find_executable_batch_size
    spy = _LoopNames()
    args = dropin_args(tmp_path, max_steps=2, save_strategy="no", auto_find_batch_size=auto_find_batch_size)
    trainer = Trainer(model=Regression(), args=args, train_dataset=Rows(16), callbacks=[spy])
    assert hf_trainer.find_executable_batch_size is stock_find  # building a Trainer patches nothing
    trainer.train()
    assert spy.find is not stock_find and trainer.state.global_step == 2
    assert hf_trainer.find_executable_batch_size is stock_find


def test_model_train_is_shadowed_for_the_one_call_transformers_makes(tmp_path) -> None:
    """lean_step: transformers' step calls ``model.train()`` on the model it is given; the instance shadow is gone
    after every step (nothing is left on the model)."""
    from tests.test_trainer_dropin import Regression, Rows
    from tests.test_trainer_dropin import _args as dropin_args

    source = inspect.getsource(transformers.Trainer.training_step)
    assert "def training_step(" in source and "model.train()" in source
    seen = []

    class Spy(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201
            seen.append("train" in vars(model))

    model = Regression()
    trainer = Trainer(model=model, args=dropin_args(tmp_path, max_steps=3, save_strategy="no"), train_dataset=Rows(16))
    trainer.add_callback(Spy())
    trainer.train()
    assert seen == [False] * 3 and "train" not in vars(model)


def test_the_optimizer_step_follows_on_pre_optimizer_step() -> None:
    """NaNGuard skips a step by giving the optimizer instance a one-call ``step`` in ``on_pre_optimizer_step``:
    transformers' loop must call ``optimizer.step()`` right after that event."""
    lines = [line.strip() for line in inspect.getsource(transformers.Trainer._run_epoch).splitlines()]
    event = next(i for i, line in enumerate(lines) if "on_pre_optimizer_step(" in line)
    assert lines[event + 1] == "self.optimizer.step()"


def test_the_callback_handler_state_is_what_duties_carry_over() -> None:
    """DutyCallbackHandler.wrap takes these attributes of transformers' handler: a new one would be lost."""
    from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

    from trainer_ext.callbacks.duties import HANDLER_STATE, DutyCallbackHandler

    handler = CallbackHandler([DefaultFlowCallback], "model", "tokenizer", "optimizer", "scheduler")
    assert set(vars(handler)) == set(HANDLER_STATE)
    wrapped = DutyCallbackHandler.wrap(handler, [])
    assert all(getattr(wrapped, name) is getattr(handler, name) for name in HANDLER_STATE)


def test_rank_prefixing_hooks_are_set_once_and_put_back_in_any_order() -> None:
    """main_process_logging chains the standard library's record factory and ``warnings.formatwarning`` on a
    non-main rank; set up twice (the Trainer's duty and a user's instance), undone in creation order, both come back."""
    from trainer_ext.callbacks.main_process_logging import configure_process_logging

    factory, formatwarning, level = logging.getLogRecordFactory(), warnings.formatwarning, logging.getLogger().level
    assert configure_process_logging(0)() is None and logging.getLogRecordFactory() is factory  # main: untouched
    first, second = configure_process_logging(1), configure_process_logging(1)
    try:
        first()
        first()  # twice: counted once
        assert logging.getLogRecordFactory() is not factory  # the second set-up still holds it
        assert warnings.formatwarning("w", UserWarning, "f.py", 1).startswith("[rank 1] ")
    finally:
        second()
    assert logging.getLogRecordFactory() is factory and warnings.formatwarning is formatwarning
    assert logging.getLogger().level == level


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
    buffer = io.BytesIO()
    torch.save({"python": random.getstate(), "numpy": np.random.get_state()}, buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError):  # numpy's RNG state is refused by weights_only alone
        torch.load(buffer, weights_only=True)
    buffer.seek(0)
    with _compat.numpy_rng_safe_globals():  # ...and loads through our allow-list, intact
        state = torch.load(buffer, weights_only=True)
    assert state["numpy"][0] == "MT19937" and np.array_equal(state["numpy"][1], np.random.get_state()[1])


def test_the_save_renaming_hook_exists() -> None:
    """UnwrapAndSaveCallback predicts saved names through transformers' weight-conversion reversal."""
    from transformers.core_model_loading import revert_weight_conversion

    assert callable(revert_weight_conversion)


# What our subclasses know of transformers' private API. Keep these lists by hand: the test below
# computes the same sets from our classes, so a rename on either side shows up as a difference.
PRIVATE_OVERRIDES = {
    transformers.Trainer: {
        "_get_num_items_in_batch",  # exact_eval: the count a batch's loss was divided by
        "_update_auto_batch_size",
        "_load_best_model",
        "_load_from_checkpoint",
        "_load_optimizer_and_scheduler",
        "_prepare_context_parallel_inputs",  # context parallelism: the batch split for every backend
        "_prepare_for_training",
        "_prepare_input",
        "_prepare_inputs",  # a packed batch runs without the key/value cache
        "_save_checkpoint",
        "_save_optimizer_and_scheduler",
    },
    transformers.TrainingArguments: {"_process_fsdp_args", "_setup_devices"},
}
PRIVATE_NAMES_USED = {
    transformers.Trainer: {"_created_lr_scheduler", "_get_output_dir", "_train_batch_size"},
    transformers.TrainingArguments: {"_n_gpu"},
}
OUR_CLASSES = {transformers.Trainer: Trainer, transformers.TrainingArguments: TrainingArguments}


def _our_bases(ours: type, theirs: type) -> list[type]:
    """The classes trainer_ext puts above ``theirs``: the subclass and its mixins."""
    return [c for c in ours.__mro__ if c.__module__.startswith("trainer_ext.") and c not in theirs.__mro__]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_references(classes: list[type]) -> tuple[set[str], set[str], list[ast.Call]]:
    """Private methods defined, private names read or set on ``self``/``super()``, and the calls made to them."""
    defined, used, calls = set(), set(), []
    for cls in classes:
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
            if isinstance(node, ast.FunctionDef) and _private(node.name):
                defined.add(node.name)
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                target = node.value
                on_self = isinstance(target, ast.Name) and target.id == "self"
                on_super = isinstance(target, ast.Call) and getattr(target.func, "id", None) == "super"
                if on_self or on_super:
                    used.add(node.attr)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _private(node.func.attr):
                calls.append(node)
    return defined, used, calls


def _signature(owner: type, name: str) -> inspect.Signature:
    member = inspect.getattr_static(owner, name)
    return inspect.signature(member.func if isinstance(member, functools.cached_property) else member)


def _incompatibilities(ours: inspect.Signature, theirs: inspect.Signature) -> list[str]:
    """Why a call that ``theirs`` accepts could fail on ``ours`` (empty when every such call binds the same way)."""
    kinds = {p.kind for p in ours.parameters.values()}
    mine = [p for p in ours.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    positions = [p.name for p in mine if p.kind != p.KEYWORD_ONLY]
    problems = []
    their_positions = [
        p.name for p in theirs.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    for index, (name, param) in enumerate(theirs.parameters.items()):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            if param.kind not in kinds:
                problems.append(f"takes no {param}")
        elif name in positions and name in their_positions:
            if positions.index(name) != their_positions.index(name):
                problems.append(f"{name!r} at another position")
        elif name not in ours.parameters and inspect.Parameter.VAR_KEYWORD not in kinds:
            if param.kind == param.KEYWORD_ONLY or inspect.Parameter.VAR_POSITIONAL not in kinds:
                problems.append(f"no parameter {name!r} (#{index})")
    for param in mine:
        if param.default is param.empty and param.name not in theirs.parameters:
            problems.append(f"requires {param.name!r}, which transformers never passes")
    return problems


@pytest.mark.parametrize("theirs", list(OUR_CLASSES), ids=lambda cls: cls.__name__)
def test_the_private_transformers_methods_we_override_or_call_exist(theirs: type) -> None:
    """Every private name our subclass overrides, calls or sets on transformers' class is still there, same shape.

    A rename upstream would leave our override unused (or our call failing mid-run) without any other test noticing.
    """
    ours = OUR_CLASSES[theirs]
    defined, used, calls = _private_references(_our_bases(ours, theirs))
    overrides = {name for name in defined if hasattr(theirs, name)}
    assert overrides == PRIVATE_OVERRIDES[theirs], "update PRIVATE_OVERRIDES after checking each difference"
    upstream = inspect.getsource(inspect.getmodule(theirs))
    theirs_used = {name for name in used - defined if hasattr(theirs, name) or f"self.{name}" in upstream}
    assert theirs_used == PRIVATE_NAMES_USED[theirs], "update PRIVATE_NAMES_USED after checking each difference"

    for name in sorted(overrides):
        problems = _incompatibilities(_signature(ours, name), _signature(theirs, name))
        assert not problems, f"{ours.__name__}.{name} vs transformers: {problems}"
    for call in calls:  # our calls of transformers' private methods must bind to their signature
        name = call.func.attr
        if name not in theirs_used | overrides:
            continue
        assert callable(getattr(theirs, name, None)), f"transformers.{theirs.__name__}.{name} is not a method"
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            continue
        try:
            _signature(theirs, name).bind(None, *call.args, **{k.arg: None for k in call.keywords})
        except TypeError as error:
            raise AssertionError(f"our call {ast.unparse(call)} does not fit transformers' {name}: {error}") from None
