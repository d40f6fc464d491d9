"""trainer_ext.Accelerator in one process: the accelerate-style members, trackers, saving, loop vs Trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaForCausalLM

from tests.helpers import jobs, loops
from tests.helpers.device import use_cpu
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Accelerator, Trainer
from trainer_ext.errors import ConfigError
from trainer_ext.trackers import TRACKERS

pytestmark = pytest.mark.timeout(300)


def test_hand_written_loop_reaches_the_trainers_weights(tmp_path: Path) -> None:
    """Same model, data, optimizer, schedule, clipping and seed: the loop and the Trainer end equal."""
    _, loop_weights, info = loops.train_loop(per_device_batch=2)
    args = jobs.make_args(tmp_path, per_device_train_batch_size=2, optim="adamw_torch", max_grad_norm=1.0)
    trainer = Trainer(model=tiny_llama(0), args=args, train_dataset=lm_dataset(40))
    trainer.train()
    assert info["scheduler_steps"] == trainer.state.global_step == 40
    for name, value in trainer.model.state_dict().items():
        assert torch.allclose(value, loop_weights[name], atol=1e-6), name


def test_members_on_one_process() -> None:
    accelerator = Accelerator(cpu=True)
    assert accelerator.device == torch.device("cpu")
    assert accelerator.is_main_process and accelerator.is_local_main_process
    assert (accelerator.process_index, accelerator.local_process_index, accelerator.num_processes) == (0, 0, 1)
    assert accelerator.distributed_type == "NO" and accelerator.mixed_precision == "no"
    calls = []
    accelerator.on_main_process(lambda: calls.append("main"))()
    assert calls == ["main"]
    with accelerator.main_process_first():
        calls.append("first")
    accelerator.wait_for_everyone()
    assert calls == ["main", "first"]
    tensor = torch.arange(4.0)
    assert torch.equal(accelerator.gather(tensor), tensor)
    assert torch.equal(accelerator.reduce(tensor, "mean"), tensor)
    assert torch.equal(accelerator.pad_across_processes(tensor), tensor)


def test_accumulate_syncs_every_nth_micro_batch_and_at_the_end_of_data() -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    model, loader = accelerator.prepare(torch.nn.Linear(2, 1), torch.utils.data.DataLoader(list(range(7))))
    syncs = []
    for _ in loader:
        with accelerator.accumulate(model):
            syncs.append(accelerator.sync_gradients)
    assert syncs == [False, False, True, False, False, True, True]  # the last, shorter window still steps


def test_backward_divides_by_the_accumulation_steps() -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    weight = torch.nn.Parameter(torch.ones(1))
    accelerator.backward((weight * 8).sum())
    assert weight.grad.item() == pytest.approx(2.0)


def test_bf16_autocast_and_unwrap_without_the_fp32_wrapper() -> None:
    accelerator = Accelerator(cpu=use_cpu(), mixed_precision="bf16")
    model = accelerator.prepare(tiny_llama(0))
    ones = torch.ones(2, 2, device=accelerator.device)
    with accelerator.autocast():
        assert ones.matmul(ones).dtype == torch.bfloat16
    ids = torch.tensor(lm_dataset(1)["input_ids"], device=accelerator.device)
    assert model(ids).logits.dtype == torch.float32
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert "_original_forward" not in plain.__dict__


def test_save_model_round_trips_and_shards(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(tiny_llama(0))
    accelerator.save_model(model, tmp_path / "whole")
    accelerator.save_model(model, tmp_path / "sharded", max_shard_size="60KB")
    assert (tmp_path / "whole" / "model.safetensors").exists()
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = torch.tensor(lm_dataset(2)["input_ids"])
    with torch.no_grad():
        expected = model(ids).logits
        for folder in ("whole", "sharded"):
            assert torch.allclose(LlamaForCausalLM.from_pretrained(tmp_path / folder)(ids).logits, expected, atol=1e-6)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    accelerator.save_model(plain, tmp_path / "plain", max_shard_size="20KB")
    assert len(list((tmp_path / "plain").glob("model-*.safetensors"))) == 2


def test_save_state_refuses_an_incomplete_checkpoint(tmp_path: Path) -> None:
    loops.train_loop(per_device_batch=2, stop_after=2, save_to=tmp_path / "state")
    (tmp_path / "state" / "COMPLETE").unlink()
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        loops.train_loop(per_device_batch=2, resume_from=tmp_path / "state")


def test_tensorboard_and_mlflow_trackers_write_files(tmp_path: Path) -> None:
    names = [n for n in ("tensorboard", "mlflow") if TRACKERS[n].available()]
    if len(names) < 2:
        pytest.skip(f"needs tensorboard and mlflow installed (dev extra); have {names}")
    accelerator = Accelerator(cpu=True, log_with=names, project_dir=tmp_path)
    accelerator.init_trackers("demo", config={"lr": 0.1, "layers": 2})
    accelerator.log({"loss": 1.5, "note": "text"}, step=1)
    accelerator.log({"loss": torch.tensor(1.0)}, step=2)
    assert accelerator.get_tracker("tensorboard", unwrap=True) is accelerator.trackers[0].writer
    accelerator.end_training()
    assert list((tmp_path / "demo").glob("events.out.tfevents*"))
    (hparams,) = (tmp_path / "demo").glob("*/hparams.yml")  # accelerate's copy of the configuration
    assert yaml.safe_load(hparams.read_text()) == {"lr": 0.1, "layers": 2}
    assert list((tmp_path / "mlruns").rglob("loss"))


def test_wandb_offline_tracker_writes_under_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As under accelerate, wandb.init gets no ``dir``: the run lands in ./wandb, not in the logging directory."""
    if not TRACKERS["wandb"].available():
        pytest.skip("wandb not installed")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    project = tmp_path / "project"
    accelerator = Accelerator(cpu=True, log_with="wandb", project_dir=project)
    accelerator.init_trackers("demo", config={"lr": 0.1})
    accelerator.log({"loss": 0.5}, step=1)
    accelerator.end_training()
    assert list((tmp_path / "wandb").rglob("*.wandb"))
    assert not list(project.rglob("*.wandb"))


def test_unknown_or_missing_tracker_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="unknown tracker 'tensorbord'.*Did you mean 'tensorboard'"):
        Accelerator(cpu=True, log_with="tensorbord")
    monkeypatch.setattr(TRACKERS["wandb"], "available", classmethod(lambda cls: False))
    with pytest.raises(ConfigError, match=r"pip install wandb \(every tracker, from a checkout: pip install -e"):
        Accelerator(cpu=True, log_with="wandb")


def test_fp16_without_cuda_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="CUDA"):
        Accelerator(mixed_precision="fp16")


def test_trackio_tracker_writes_locally(tmp_path: Path) -> None:
    if not TRACKERS["trackio"].available():
        pytest.skip("trackio not installed")
    import os
    import subprocess
    import sys

    code = (
        "from trainer_ext import Accelerator\n"
        "a = Accelerator(cpu=True, log_with='trackio')\n"
        "a.init_trackers('demo-project', config={'lr': 0.1})\n"
        "a.log({'loss': 0.5}, step=1)\n"
        "a.end_training()\n"
    )
    env = dict(os.environ, HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(tmp_path.rglob("demo-project*.db"))


def test_get_tracker_is_blank_where_no_tracker_runs(tmp_path: Path) -> None:
    """accelerate's blank tracker: ``get_tracker(name).log(...)`` is safe on every rank and before init_trackers."""
    untracked = Accelerator(cpu=True)
    for blank in (
        untracked.get_tracker("wandb"),
        Accelerator(cpu=True, log_with="tensorboard").get_tracker("tensorboard"),
    ):
        assert blank.log({"loss": 1.0}, step=3, commit=False) is None
        assert blank.store_init_configuration({"lr": 0.1}) is None and blank.finish() is None
    backend = untracked.get_tracker("wandb", unwrap=True)
    assert backend.log({"loss": 1.0}) is None and backend.config.update({"lr": 0.1}) is None
    assert backend.add_scalar("loss", 1.0, global_step=2) is None
    untracked.log({"loss": 1.0}, step=1, log_kwargs={"wandb": {"commit": False}})  # no tracker: nothing happens
    with pytest.raises(ConfigError, match=r"no tracker 'wandb': log_with asked for \['tensorboard'\]"):
        Accelerator(cpu=True, log_with="tensorboard", project_dir=tmp_path).get_tracker("wandb")


def test_log_kwargs_reach_the_tracker(tmp_path: Path) -> None:
    if not TRACKERS["tensorboard"].available():
        pytest.skip("tensorboard not installed (dev extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=tmp_path)
    accelerator.init_trackers("demo")
    accelerator.log({"loss": 2.0}, step=4, log_kwargs={"tensorboard": {"walltime": 123.0}, "wandb": {"x": 1}})
    accelerator.end_training()
    events = EventAccumulator(str(next((tmp_path / "demo").glob("events.out.tfevents*"))))
    events.Reload()
    [event] = events.Scalars("loss")
    assert (event.step, event.value, event.wall_time) == (4, 2.0, 123.0)


def test_save_writes_torch_or_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    accelerator = Accelerator(cpu=True)
    state = {"weight": torch.arange(6.0).reshape(2, 3).t(), "step": torch.tensor(7)}  # a non-contiguous view
    accelerator.save({"state": state, "note": "any object"}, tmp_path / "obj.pt")
    assert torch.load(tmp_path / "obj.pt", weights_only=True)["note"] == "any object"
    accelerator.save(state, tmp_path / "state.safetensors", safe_serialization=True)
    loaded = load_file(str(tmp_path / "state.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    with pytest.raises(ConfigError, match="dict of tensors, got list"):
        accelerator.save([torch.ones(1)], tmp_path / "bad.safetensors", safe_serialization=True)
    with pytest.raises(ConfigError, match="safetensors only"):
        accelerator.save_model(torch.nn.Linear(2, 2), tmp_path / "model", safe_serialization=False)
    assert not (tmp_path / "model").exists()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
def test_scheduler_steps_once_per_call_when_not_tied_to_the_optimizer() -> None:
    """step_scheduler_with_optimizer=False (accelerate's meaning): every ``scheduler.step()`` call steps it."""
    steps = {}
    for tied in (True, False):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, step_scheduler_with_optimizer=tied)
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        model, optimizer, loader, scheduler = accelerator.prepare(
            model, optimizer, torch.utils.data.DataLoader(torch.ones(8, 2), batch_size=2), scheduler
        )
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).sum())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        steps[tied] = scheduler.scheduler.last_epoch
    assert steps == {True: 2, False: 4}  # 4 micro-batches, 2 optimizer steps


def test_device_placement_false_leaves_models_and_batches_where_they_are() -> None:
    """Meta tensors cannot be copied to the CPU: preparing them only works when nothing is moved."""
    batches = torch.utils.data.DataLoader(
        range(4), batch_size=2, collate_fn=lambda rows: torch.empty(2, device="meta")
    )
    accelerator = Accelerator(cpu=True, device_placement=False)
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    model, loader = accelerator.prepare(model, batches)
    assert model.weight.device.type == "meta"
    assert [batch.device.type for batch in loader] == ["meta", "meta"]
    placed = Accelerator(cpu=True)
    with pytest.raises(NotImplementedError, match="meta"):
        list(placed.prepare(batches))
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    assert placed.prepare(model, device_placement=[False]).weight.device.type == "meta"
    assert [b.device.type for b in placed.prepare(batches, device_placement=[False])] == ["meta", "meta"]
    assert [b.device.type for b in placed.prepare_data_loader(batches, device_placement=False)] == ["meta", "meta"]
    with pytest.raises(ConfigError, match="device_placement has 2 entries for 1 objects"):
        placed.prepare(model, device_placement=[False, True])


def test_one_rank_save_state_resume_mid_epoch_is_bitwise(tmp_path: Path) -> None:
    """Stopped after 3 of 10 batches of the first epoch, saved, resumed: the uninterrupted loop's weights, bit for bit."""
    _, full, full_info = loops.train_loop(per_device_batch=2)
    loops.train_loop(per_device_batch=2, stop_after=3, save_to=tmp_path / "state")
    _, resumed, info = loops.train_loop(per_device_batch=2, resume_from=tmp_path / "state")
    assert info == full_info
    start = tiny_llama(0).state_dict()
    assert all(not torch.equal(full[k].cpu(), start[k]) for k in full)
    assert all(torch.equal(full[k], resumed[k]) for k in full)


class Counter:
    """A user's object with state (what ``register_for_checkpointing`` is for)."""

    def __init__(self) -> None:
        self.count, self.best = 0, torch.tensor(float("inf"))

    def state_dict(self) -> dict:
        return {"count": self.count, "best": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.best = state["count"], state["best"]


def test_register_for_checkpointing_and_load_state_without_a_directory(tmp_path: Path) -> None:
    """save_state() goes under project_dir/checkpoints; load_state() takes the newest complete one there."""
    accelerator = Accelerator(cpu=True, project_dir=tmp_path)
    with pytest.raises(ConfigError, match="no complete checkpoint under"):
        accelerator.load_state()
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    with pytest.raises(ConfigError, match="object has no state_dict/load_state_dict"):
        accelerator.register_for_checkpointing(object())
    counter.count, counter.best = 1, torch.tensor(0.5)
    accelerator.save_state(tmp_path / "checkpoints" / "older")
    counter.count, counter.best = 5, torch.tensor(0.25)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    assert accelerator.save_state() == str(tmp_path / "checkpoints" / "checkpoint")
    (tmp_path / "checkpoints" / "interrupted").mkdir()  # newer, but never committed: no COMPLETE marker
    counter.count, counter.best = 0, torch.tensor(9.0)
    torch.nn.init.zeros_(model.weight)
    accelerator.load_state()
    assert counter.count == 5 and counter.best.item() == 0.25
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    with pytest.raises(ConfigError, match="needs a directory, or project_dir"):
        Accelerator(cpu=True).load_state()


@pytest.mark.gpu
def test_unscale_gradients_of_one_optimizer_under_fp16() -> None:
    """fp16 gradients carry the loss scale until ``unscale_gradients(optimizer=...)``; then they are the true ones."""
    accelerator = Accelerator(mixed_precision="fp16")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    reference = torch.nn.Linear(8, 1).to(accelerator.device)
    reference.load_state_dict(model.state_dict())
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    inputs = torch.randn(4, 8, device=accelerator.device)
    accelerator.backward(model(inputs).float().sum())
    reference(inputs).sum().backward()
    scale = accelerator.scaler.get_scale()
    assert scale > 1 and torch.allclose(model.weight.grad / scale, reference.weight.grad, rtol=1e-2, atol=1e-4)
    accelerator.unscale_gradients(optimizer=optimizer)
    assert torch.allclose(model.weight.grad, reference.weight.grad, rtol=1e-2, atol=1e-4)
