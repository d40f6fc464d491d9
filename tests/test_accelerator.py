"""trainer_ext.Accelerator in one process: the accelerate-style members, trackers, saving, loop vs Trainer."""

from __future__ import annotations

import json
from pathlib import Path

import jobs
import loops
import pytest
import torch
from tiny import lm_dataset, tiny_llama
from transformers import LlamaForCausalLM

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
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = accelerator.prepare(tiny_llama(0))
    with accelerator.autocast():
        assert torch.ones(2, 2).matmul(torch.ones(2, 2)).dtype == torch.bfloat16
    ids = torch.tensor(lm_dataset(1)["input_ids"])
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
    assert list((tmp_path / "mlruns").rglob("loss"))


def test_wandb_offline_tracker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not TRACKERS["wandb"].available():
        pytest.skip("wandb not installed")
    monkeypatch.setenv("WANDB_SILENT", "true")
    accelerator = Accelerator(cpu=True, log_with="wandb", project_dir=tmp_path)
    accelerator.init_trackers("demo", config={"lr": 0.1}, init_kwargs={"wandb": {"mode": "offline"}})
    accelerator.log({"loss": 0.5}, step=1)
    accelerator.end_training()
    assert list(tmp_path.rglob("*.wandb"))


def test_unknown_or_missing_tracker_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="unknown tracker 'tensorbord'.*Did you mean 'tensorboard'"):
        Accelerator(cpu=True, log_with="tensorbord")
    monkeypatch.setattr(TRACKERS["wandb"], "available", classmethod(lambda cls: False))
    with pytest.raises(ConfigError, match=r"pip install 'trainer_ext\[trackers\]'"):
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
