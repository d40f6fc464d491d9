"""accelerate's Accelerator API on trainer_ext.Accelerator, one process: project configuration, hooks, decorators,
splitting, triggers, kwargs handlers, the scheduler rule, plugins refused with a pointer to our setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer_ext import (
    Accelerator,
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    ProfileKwargs,
    ProjectConfiguration,
)
from trainer_ext.distributed.data.split import share_of as _split
from trainer_ext.errors import ConfigError


def _prepared(accelerator: Accelerator, samples: int = 8, batch: int = 2):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.randn(samples, 2), batch_size=batch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return accelerator.prepare(model, optimizer, loader, scheduler)


def _train_epoch(accelerator: Accelerator, model, optimizer, loader, scheduler) -> None:
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(batch).pow(2).mean())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


# -- ProjectConfiguration ----------------------------------------------------------------------------
def test_automatic_checkpoint_naming_numbers_folders_and_keeps_total_limit(tmp_path: Path) -> None:
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(cpu=True, project_config=config)
    model, optimizer, loader, scheduler = _prepared(accelerator)
    saved = []
    for _ in range(3):
        _train_epoch(accelerator, model, optimizer, loader, scheduler)
        saved.append(Path(accelerator.save_state()).name)
    assert saved == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
    assert accelerator.save_iteration == config.iteration == 3
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _train_epoch(accelerator, model, optimizer, loader, scheduler)
    accelerator.load_state()  # the newest: checkpoint_2
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_an_existing_numbered_folder_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "checkpoint_0").mkdir(parents=True)
    (tmp_path / "checkpoints" / "checkpoint_0" / "keep.txt").write_text("mine")
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    _prepared(accelerator)
    with pytest.raises(ValueError, match=r"checkpoint_0 \(0\) already exists"):
        accelerator.save_state()
    assert (tmp_path / "checkpoints" / "checkpoint_0" / "keep.txt").read_text() == "mine"


def test_project_dir_and_logging_dir(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, project_dir=tmp_path)
    assert accelerator.project_dir == accelerator.logging_dir == str(tmp_path)
    config = ProjectConfiguration(project_dir=str(tmp_path), logging_dir=str(tmp_path / "logs"))
    accelerator = Accelerator(cpu=True, project_config=config)
    assert accelerator.logging_dir == str(tmp_path / "logs")


# -- hooks -------------------------------------------------------------------------------------------
def test_save_and_load_pre_hooks_see_the_models_and_can_take_one_over(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model, *_ = _prepared(accelerator)
    calls: list[str] = []

    def save_hook(models, weights, output_dir):
        calls.append(f"save {len(models)} {len(weights)}")
        torch.save(weights.pop(0), Path(output_dir) / "my_model.pt")  # the hook writes the model itself

    def load_hook(models, input_dir):
        calls.append(f"load {len(models)}")
        models.pop(0).load_state_dict(torch.load(Path(input_dir) / "my_model.pt"))

    handles = [
        accelerator.register_save_state_pre_hook(save_hook),
        accelerator.register_load_state_pre_hook(load_hook),
    ]
    accelerator.save_state(tmp_path / "state")
    files = {p.name for p in (tmp_path / "state").iterdir()}
    assert "my_model.pt" in files and not any(name.startswith("model") for name in files)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    accelerator.load_state(tmp_path / "state")
    assert torch.equal(model.weight, saved["weight"])
    assert calls == ["save 1 1", "load 1"]
    for handle in handles:
        handle.remove()
    accelerator.save_state(tmp_path / "again")
    assert calls == ["save 1 1", "load 1"]


# -- the scheduler and accumulation ------------------------------------------------------------------
def test_scheduler_rule_and_the_explicit_option() -> None:
    """One process: one step per optimizer step either way; accumulation 2 over 4 micro-batches: 2 steps."""
    for counts in (False, True):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, scheduler_counts_optimizer_steps=counts)
        model, optimizer, loader, scheduler = _prepared(accelerator)
        _train_epoch(accelerator, model, optimizer, loader, scheduler)
        assert scheduler.scheduler.last_epoch == 2


def test_gradient_accumulation_plugin_and_its_conflict() -> None:
    plugin = GradientAccumulationPlugin(num_steps=4, sync_with_dataloader=False)
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    assert accelerator.gradient_accumulation_steps == 4
    model, optimizer, loader, scheduler = _prepared(accelerator, samples=12)  # 6 micro-batches
    syncs = []
    for _batch in loader:
        with accelerator.accumulate(model):
            syncs.append(accelerator.sync_gradients)
    assert syncs == [False, False, False, True, False, False]  # no sync forced at the end of the data
    assert accelerator.step == 6  # accelerate's count: reset at the end of a loader only when syncing with it
    with pytest.raises(ValueError, match="only pass one of `gradient_accumulation_steps`"):
        Accelerator(cpu=True, gradient_accumulation_steps=2, gradient_accumulation_plugin=plugin)


def test_accumulate_step_count_restarts_with_each_loader() -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model, optimizer, loader, scheduler = _prepared(accelerator, samples=12)
    syncs = []
    for _batch in loader:
        with accelerator.accumulate(model):
            syncs.append(accelerator.sync_gradients)
    assert syncs == [False, False, False, True, False, True] and accelerator.step == 0


# -- processes ---------------------------------------------------------------------------------------
def test_decorators_on_one_process_run_everywhere() -> None:
    accelerator = Accelerator(cpu=True)

    @accelerator.on_main_process
    def main() -> str:
        return "main"

    @accelerator.on_process(process_index=0)
    def first() -> str:
        return "first"

    @accelerator.on_local_process(local_process_index=1)
    def second_local() -> str:
        return "second"  # a run without several processes runs it too (accelerate's rule)

    @Accelerator.on_last_process
    def last() -> str:
        return "last"

    assert (main(), first(), second_local(), last()) == ("main", "first", "second", "last")
    assert main.__name__ == "main"


def test_split_between_processes_shares() -> None:
    """accelerate's split: contiguous shares, the first ``len % n`` processes get one more; padding repeats the last."""
    letters = ["A", "B", "C", "D", "E"]
    assert [_split(letters, 2, i, False) for i in range(2)] == [["A", "B", "C"], ["D", "E"]]
    assert [_split(letters, 2, i, True) for i in range(2)] == [["A", "B", "C"], ["D", "E", "E"]]
    assert [_split(letters, 3, i, True) for i in range(3)] == [["A", "B"], ["C", "D"], ["E", "E"]]
    assert _split(["A"], 2, 1, False) == [] and _split(["A"], 2, 1, True) == ["A"]
    tensor = torch.arange(10).reshape(5, 2)
    assert _split(tensor, 2, 1, True).tolist() == [[6, 7], [8, 9], [8, 9]]
    parts = _split({"a": [1, 2, 3], "b": torch.tensor([4, 5, 6])}, 2, 0, False)
    assert parts["a"] == [1, 2] and parts["b"].tolist() == [4, 5]
    with pytest.raises(ValueError, match="same length"):
        _split({"a": [1], "b": [1, 2]}, 2, 0, False)
    accelerator = Accelerator(cpu=True)
    with accelerator.split_between_processes(letters) as mine:
        assert mine is letters  # one process: everything


def test_trigger() -> None:
    accelerator = Accelerator(cpu=True)
    assert not accelerator.check_trigger()
    accelerator.set_trigger()
    assert accelerator.check_trigger() and not accelerator.check_trigger()


def test_join_uneven_inputs_on_one_process_is_a_plain_block() -> None:
    accelerator = Accelerator(cpu=True)
    model, *_ = _prepared(accelerator)
    with accelerator.join_uneven_inputs([model], even_batches=False):
        pass
    assert accelerator.even_batches


# -- handlers and configuration ----------------------------------------------------------------------
def test_autocast_handler_and_profile(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)])
    with accelerator.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with accelerator.autocast(autocast_handler=AutocastKwargs(enabled=True)):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with accelerator.profile(ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path))) as profiler:
        torch.ones(8, 8) @ torch.ones(8, 8)
    assert any("mm" in event.name for event in profiler.events())
    assert json.loads((tmp_path / "profile_0.json").read_text())["traceEvents"]


def test_grad_scaler_kwargs_reach_the_engine() -> None:
    accelerator = Accelerator(cpu=True, kwargs_handlers=[GradScalerKwargs(init_scale=8.0, growth_interval=3)])
    assert accelerator.scaler_handler.to_kwargs() == {"init_scale": 8.0, "growth_interval": 3}
    with pytest.raises(ValueError, match="only pass one"):
        Accelerator(cpu=True, kwargs_handlers=[GradScalerKwargs(), GradScalerKwargs()])


def test_dataloader_configuration_attributes() -> None:
    config = DataLoaderConfiguration(even_batches=False, use_seedable_sampler=True, non_blocking=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    assert (accelerator.even_batches, accelerator.use_seedable_sampler, accelerator.non_blocking) == (
        False,
        True,
        True,
    )
    assert (accelerator.split_batches, accelerator.dispatch_batches) == (False, None)
    accelerator.even_batches = True
    assert accelerator.engine.even_batches and config.even_batches
    with pytest.warns(FutureWarning, match="split_batches"):
        assert Accelerator(cpu=True, split_batches=True).split_batches
    with pytest.raises(ValueError, match="both the Accelerator and the DataLoaderConfiguration"):
        Accelerator(cpu=True, split_batches=True, dataloader_config=DataLoaderConfiguration())


def test_plugins_and_unknown_rng_types_are_refused_with_our_setting() -> None:
    with pytest.raises(TypeError, match="must be a FullyShardedDataParallelPlugin object"):  # accelerate's type
        Accelerator(cpu=True, fsdp_plugin=object())
    with pytest.raises(ConfigError, match="deepspeed_config="):
        Accelerator(cpu=True, deepspeed_plugin=object())
    with pytest.raises(ConfigError, match="rng_types"):
        Accelerator(cpu=True, rng_types=["numpy"])


def test_top_level_names() -> None:
    accelerator = Accelerator(cpu=True)
    assert accelerator.distributed_type == DistributedType.NO
    assert not accelerator.multi_device and not accelerator.is_fsdp2 and accelerator.should_save_model
    assert accelerator.rng_types == ["generator"]
    model = torch.nn.Linear(2, 2)
    assert not accelerator.verify_device_map(model)
    model.hf_device_map = {"a": 0, "b": "cpu"}
    assert accelerator.verify_device_map(model)
    with accelerator.trigger_sync_in_backward(model):  # not DDP: nothing to do
        pass


def test_load_state_names_the_files_a_run_needs_that_a_checkpoint_lacks(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    _prepared(accelerator)
    accelerator.save_state(tmp_path / "state")
    more = Accelerator(cpu=True)
    _prepared(more)
    second = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]), lambda s: 1.0)
    more.prepare_scheduler(second)
    with pytest.raises(ConfigError, match=r"has no scheduler_1\.bin: it was written for other prepared objects"):
        more.load_state(tmp_path / "state")


def test_lomo_backward_needs_a_lomo_optimizer() -> None:
    accelerator = Accelerator(cpu=True)
    model, *_ = _prepared(accelerator)
    with pytest.raises(ValueError, match="Backward pass not properly called on LOMO optimizers"):
        accelerator.lomo_backward(model(torch.ones(1, 2)).sum(), 0.1)
    with pytest.raises(ValueError, match="Unsupported kwargs handler passed: GradientAccumulationPlugin"):
        Accelerator(cpu=True, kwargs_handlers=[GradientAccumulationPlugin(num_steps=2)])
