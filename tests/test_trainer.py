"""trainer_ext.Trainer in one process: train, evaluate, predict, save, checkpoints, resume, callbacks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, TrainerCallback

from tests.helpers import jobs
from tests.helpers.ranks import child_env
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer, TrainingArguments
from trainer_ext.errors import ConfigError

pytestmark = pytest.mark.timeout(300)


class Recorder(TrainerCallback):
    """Records which callback events fired and how often."""

    def __init__(self) -> None:
        self.events: dict[str, int] = {}

    def _hit(self, name: str) -> None:
        self.events[name] = self.events.get(name, 0) + 1

    def on_train_begin(self, args, state, control, **kw):
        self._hit("train_begin")

    def on_step_end(self, args, state, control, **kw):
        self._hit("step_end")

    def on_evaluate(self, args, state, control, **kw):
        self._hit("evaluate")

    def on_save(self, args, state, control, **kw):
        self._hit("save")

    def on_train_end(self, args, state, control, **kw):
        self._hit("train_end")


@pytest.mark.compat
def test_train_evaluate_predict_save_and_reload(tmp_path: Path) -> None:
    recorder = Recorder()
    args = jobs.make_args(
        tmp_path,
        num_train_epochs=2,
        eval_strategy="epoch",
        save_strategy="epoch",
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        save_total_limit=1,
    )
    trainer = Trainer(
        model=tiny_llama(0),
        args=args,
        train_dataset=lm_dataset(16),
        eval_dataset=lm_dataset(6, seed=9),
        callbacks=[recorder],
    )
    before = trainer.evaluate()["eval_loss"]
    result = trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert result.global_step == 16  # 2 epochs x (16 samples / batch 2)
    assert after < before, "training on the pattern must lower the eval loss"
    assert recorder.events["train_begin"] == 1 and recorder.events["train_end"] == 1
    assert recorder.events["step_end"] == result.global_step
    assert recorder.events["evaluate"] >= 2 and recorder.events["save"] == 2
    assert trainer.state.best_model_checkpoint is not None

    predictions = trainer.predict(lm_dataset(3, seed=4)).predictions
    assert predictions.shape == (3, 12, 64)

    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "model.safetensors").exists()
    reloaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "final"))
    batch = torch.tensor(lm_dataset(2, seed=7)["input_ids"])
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(batch).logits, model(batch).logits, atol=1e-6)
    assert "accelerate" not in sys.modules


def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path: Path) -> None:
    """The metric peaks at epoch 2 of 3: that checkpoint's weights, not the last epoch's, end in the model."""
    scores = iter([0.2, 0.9, 0.5])  # one per evaluation, so the best checkpoint is not the newest

    def peak_at_epoch_two(prediction) -> dict[str, float]:
        return {"score": next(scores)}

    args = jobs.make_args(
        tmp_path,
        num_train_epochs=3,
        eval_strategy="epoch",
        save_strategy="epoch",
        load_best_model_at_end=True,
        metric_for_best_model="score",
        greater_is_better=True,
    )
    trainer = Trainer(
        model=tiny_llama(0),
        args=args,
        train_dataset=lm_dataset(8),
        eval_dataset=lm_dataset(4, 9),
        compute_metrics=peak_at_epoch_two,
    )
    trainer.train()
    assert [h["eval_score"] for h in trainer.state.log_history if "eval_score" in h] == [0.2, 0.9, 0.5]
    assert Path(trainer.state.best_model_checkpoint).name == "checkpoint-8"
    best = LlamaForCausalLM.from_pretrained(str(tmp_path / "checkpoint-8")).state_dict()
    last = LlamaForCausalLM.from_pretrained(str(tmp_path / "checkpoint-12")).state_dict()
    final = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    assert best.keys() == final.keys()
    for name, value in best.items():
        assert torch.equal(value, final[name]), name
    assert jobs.max_abs_diff(last, final) > 1e-3, "the last epoch's weights must differ for the test to mean anything"


@pytest.mark.compat
@pytest.mark.parametrize("grad_accum,stop", [(1, 5), (2, 3)])
def test_mid_epoch_resume_is_bitwise_equal(tmp_path: Path, grad_accum: int, stop: int) -> None:
    result = jobs.resume_jobs(tmp_path, per_device_batch=2, grad_accum=grad_accum, stop=stop)
    info = result["info"]
    steps_per_epoch = 12 // grad_accum
    assert info["interrupted_at"] == stop and stop % steps_per_epoch != 0, "must stop mid-epoch"
    assert info["steps_resumed"] == info["steps_full"] == info["max_steps"]
    for name, value in result["full"].items():
        assert torch.equal(value, result["resumed"][name]), name
    checkpoint = tmp_path / "part" / f"checkpoint-{stop}"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == stop


def test_bf16_on_cpu_trains_with_fp32_master_weights(tmp_path: Path) -> None:
    model = tiny_llama(0)
    seen: set[torch.dtype] = set()
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    trainer = Trainer(model=model, args=jobs.make_args(tmp_path, bf16=True, max_steps=3), train_dataset=lm_dataset(8))
    out = trainer.train()
    assert seen == {torch.bfloat16}, "the forward must run under bf16 autocast"
    assert torch.isfinite(torch.tensor(out.training_loss))
    assert trainer.accelerator.mixed_precision == "bf16"
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    logits = trainer.model(torch.tensor(lm_dataset(1)["input_ids"])).logits
    assert logits.dtype == torch.float32, "outputs come back in fp32"


def test_training_args_reload_rebuilds_their_devices(tmp_path: Path) -> None:
    """training_args.bin from a run loads back with a fresh distributed state of the loading process."""
    args = jobs.make_args(tmp_path, max_steps=1, save_strategy="steps", save_steps=1)
    Trainer(model=tiny_llama(0), args=args, train_dataset=lm_dataset(4)).train()
    loaded = torch.load(tmp_path / "checkpoint-1" / "training_args.bin", weights_only=False)
    assert isinstance(loaded, TrainingArguments)
    assert loaded.distributed_state is not None and loaded.distributed_state is not args.distributed_state
    assert loaded.device == torch.device("cpu") and loaded.world_size == 1
    assert loaded.learning_rate == args.learning_rate


def test_torch_compile_after_an_evaluation_keeps_the_users_module(tmp_path: Path) -> None:
    """Compiling in place: evaluate() before train() must not hide the model from wrapping and unwrapping."""
    args = jobs.make_args(tmp_path, max_steps=2, torch_compile=True, torch_compile_backend="eager")
    reference = Trainer(
        model=tiny_llama(0), args=jobs.make_args(tmp_path / "ref", max_steps=2), train_dataset=lm_dataset(8)
    )
    reference.train()
    trainer = Trainer(model=tiny_llama(0), args=args, train_dataset=lm_dataset(8), eval_dataset=lm_dataset(4, seed=2))
    trainer.evaluate()
    trainer.train()
    assert trainer.accelerator.unwrap_model(trainer.model_wrapped) is trainer.model
    assert getattr(trainer.model, "_compiled_call_impl", None) is not None
    for name, value in reference.model.state_dict().items():
        assert torch.allclose(value, trainer.model.state_dict()[name], atol=2e-4), name  # graph-level numerics


@pytest.mark.parametrize(
    "flags,match",
    [
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size must be at least 1"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be at least 1"),
        ({"per_device_eval_batch_size": 0}, "per_device_eval_batch_size"),
        ({"learning_rate": -1.0}, "learning_rate must not be negative"),
        ({"dataloader_num_workers": -1}, "dataloader_num_workers"),
        ({"torch_compile_backend": "nosuch"}, "not a torch.compile backend"),
    ],
)
def test_values_that_would_fail_mid_run_are_refused_up_front(tmp_path: Path, flags: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TrainingArguments(output_dir=str(tmp_path), **flags)


def test_fp16_without_cuda_is_a_clear_error(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="CUDA"):
        TrainingArguments(output_dir=str(tmp_path), fp16=True)
    assert not any(tmp_path.iterdir())


def test_tensorboard_report_to(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    args = jobs.make_args(tmp_path, max_steps=2, report_to="tensorboard")
    Trainer(model=tiny_llama(0), args=args, train_dataset=lm_dataset(8)).train()
    assert list(tmp_path.rglob("events.out.tfevents*"))


_NO_ACCELERATE = textwrap.dedent(
    """
    import sys

    sys.modules["accelerate"] = None  # `import accelerate` fails, find_spec says it is not installed
    from tests.helpers import jobs
    from tests.helpers.tiny import lm_dataset, tiny_llama
    from trainer_ext import Trainer

    args = jobs.make_args({out!r}, max_steps=4, eval_strategy="steps", eval_steps=2, save_steps=2, save_strategy="steps")
    trainer = Trainer(model=tiny_llama(0), args=args, train_dataset=lm_dataset(8), eval_dataset=lm_dataset(3, 2))
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model({out!r} + "/final")
    loaded = sorted(m for m, mod in sys.modules.items() if m.split(".")[0] == "accelerate" and mod is not None)
    assert not loaded, loaded
    print("OK", metrics["eval_loss"])
    """
)


@pytest.mark.compat
def test_full_run_without_accelerate(tmp_path: Path) -> None:
    """Train + eval + save in an interpreter where `import accelerate` fails."""
    code = _NO_ACCELERATE.format(out=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "OK" in proc.stdout
    assert (tmp_path / "final" / "model.safetensors").exists()
    assert (tmp_path / "checkpoint-4").is_dir()
