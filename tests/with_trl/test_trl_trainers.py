"""TRL's trainers on our engine through ``trainer_ext.adapt``: the same losses as TRL's stock path, 2 processes as 1,
and a resumed run bitwise equal to the uninterrupted one.

Each case is ``trl_job`` (a TRL quick-start script on a tiny Llama and local rows) run in its own process (one plain
``python`` process, or 2 ranks forked from the warm server with torchrun's variables: ``tests.helpers.ranks``): ``stock``
is TRL as installed (accelerate underneath), ``ours`` changes one line, ``Trainer = adapt(Trainer)``. Measured on CPU
fp32: stock and ours agree bitwise, and 2 processes agree with 1 within 2.4e-7 relative (reward; SFT 1.3e-7, DPO
1.1e-7: another reduction order).
The same script also starts under ``trainer-ext launch --num_processes 2`` and trains a LoRA adapter through
``peft_config=LoraConfig(...)``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import fields
from functools import cache
from pathlib import Path

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tests.helpers.ranks import run_ranks  # noqa: E402
from tests.with_trl.trl_job import TRAINERS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORK = Path(os.environ.get("TRL_TEST_DIR", "")) if os.environ.get("TRL_TEST_DIR") else None
SAME_PROCESS_COUNT_RTOL = 0.0  # stock vs ours on one process: bitwise
TWO_PROCESSES_RTOL = 1e-5  # 2 ranks x batch 2 vs 1 x batch 4: the same samples per step, another reduction order
TWO_PROCESSES_WEIGHTS_ATOL = 1e-5


@cache
def _root() -> Path:
    import tempfile

    return WORK or Path(tempfile.mkdtemp(prefix="trl-tests-"))


def _run(trainer: str, impl: str, name: str, nproc: int = 1, resume_from: str | None = None) -> dict:
    """One ``trl_job`` run (cached by ``name``); its result.json plus the folder it wrote."""
    return _cached(trainer, impl, name, nproc, resume_from)


@cache
def _cached(trainer: str, impl: str, name: str, nproc: int, resume_from: str | None) -> dict:
    out = _root() / trainer / name
    shutil.rmtree(out, ignore_errors=True)
    extra: list[str] = []
    if resume_from is not None:  # only the interrupted run's checkpoint-3, as after a crash at step 4
        source = _root() / trainer / resume_from / "checkpoint-3"
        shutil.copytree(source, out / "checkpoint-3")
        extra.append("--resume")
    batch = 4 // nproc
    args = ["--trainer", trainer, "--impl", impl, "--out", str(out), "--per_device_train_batch_size", str(batch)]
    if nproc > 1:  # ranks forked from the warm server, with torchrun's variables (or torchrun itself)
        run_ranks("tests.with_trl.trl_job", nproc, *args, *extra, timeout=600)
    else:  # one plain process, as `python script.py` (no launcher variables: accelerate's NO, not MULTI_CPU)
        command = [sys.executable, "-m", "tests.with_trl.trl_job", *args, *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    result = json.loads((out / "result.json").read_text())
    result["weights"] = load_file(out / "final" / "model.safetensors")
    return result


def _needed(test: str, trainer: str, nproc: int) -> list[tuple]:
    """The runs one test reads, as ``_cached`` arguments, in the order they can be made."""
    ours, two = (trainer, "ours", "ours", 1, None), (trainer, "ours", "ours_2proc", 2, None)
    if test.startswith("test_adapted"):
        return [(trainer, "stock", "stock", 1, None), ours]
    if test.startswith("test_two"):
        return [ours, two]
    full = ours if nproc == 1 else two
    return [full, (trainer, "ours", full[2].replace("ours", "resumed"), nproc, full[2])]


@pytest.fixture(scope="module", autouse=True)
def _runs_two_at_a_time(request: pytest.FixtureRequest) -> None:
    """Make the selected tests' runs beforehand, two at a time (each run is mostly imports: ~8 s alone on 2 cores);
    runs that resume wait for the ones they resume from."""
    from concurrent.futures import ThreadPoolExecutor

    first, second = [], []
    for item in request.session.items:
        if item.module is request.module and "trainer" in getattr(getattr(item, "callspec", None), "params", {}):
            params = item.callspec.params
            runs = _needed(item.originalname, params["trainer"], params.get("nproc", 1))
            for run in runs:
                (second if run[4] else first).append(run)

    def make(run: tuple) -> None:
        try:
            _cached(*run)
        except Exception:  # not cached: the test that reads this run makes it again and fails with its output
            pass

    _root()  # one folder for every thread
    with ThreadPoolExecutor(max_workers=2) as pool:
        for batch in (first, second):
            list(pool.map(make, dict.fromkeys(batch)))


def _job(out: Path, *argv: str, launcher: list[str] | None = None) -> dict:
    """``trl_job`` with ``argv`` (an SFT run of ours unless told), started by ``launcher`` or plain ``python``."""
    job = [str(ROOT / "tests" / "with_trl" / "trl_job.py"), "--out", str(out), *argv]
    command = [sys.executable, *(launcher or []), *job]
    env = {k: v for k, v in os.environ.items() if k != "TRAINER_EXT_CONFIG_FILE"}  # no launch config of the user's
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HOME=str(out.parent))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return json.loads((out / "result.json").read_text())


def _losses(result: dict) -> dict[str, float]:
    return {step: entry["loss"] for step, entry in result["steps"].items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_adapted_trainer_matches_trl_on_its_stock_path(trainer: str) -> None:
    stock, ours = _run(trainer, "stock", "stock"), _run(trainer, "ours", "ours")
    assert stock["engine"] == "accelerate.accelerator.Accelerator"  # the stock path is accelerate's
    assert ours["engine"] == "trainer_ext.distributed.engine.Engine"
    assert (
        ours["args_type"][1] == "trainer_ext.trainer.training_args.TrainingArguments"
    )  # re-based, TRL's config first
    assert ours["args_type"][0] == "trainer_ext.trainer.adapt." + stock["args_type"][0].rsplit(".", 1)[1]
    assert ours["args_type"][2] == stock["args_type"][0]  # TRL's config, right behind ours in the MRO
    assert len(ours["steps"]) == 6 and ours["final_step"] == stock["final_step"] == 6
    for step, loss in _losses(stock).items():
        assert ours["steps"][step]["loss"] == pytest.approx(loss, rel=SAME_PROCESS_COUNT_RTOL, abs=0.0), step
        assert ours["steps"][step]["learning_rate"] == stock["steps"][step]["learning_rate"], step
    assert _max_diff(stock["weights"], ours["weights"]) == 0.0
    # the same files, plus the COMPLETE marker our checkpoints are committed by (docs/trainer.md)
    assert set(ours["files"]) - {"checkpoint-3/COMPLETE", "checkpoint-6/COMPLETE"} == set(stock["files"])


@pytest.mark.parametrize("trainer", TRAINERS)
def test_two_processes_train_as_one(trainer: str) -> None:
    one, two = _run(trainer, "ours", "ours"), _run(trainer, "ours", "ours_2proc", nproc=2)
    assert two["world_size"] == 2 and two["engine"] == "trainer_ext.distributed.engine.Engine"
    assert _losses(two).keys() == _losses(one).keys()
    relative = max(abs(two["steps"][step]["loss"] - loss) / abs(loss) for step, loss in _losses(one).items())
    print(f"{trainer}: max relative |loss of 2 processes - loss of 1| = {relative:.2e}")
    for step, loss in _losses(one).items():
        assert two["steps"][step]["loss"] == pytest.approx(loss, rel=TWO_PROCESSES_RTOL), step
    assert _max_diff(one["weights"], two["weights"]) <= TWO_PROCESSES_WEIGHTS_ATOL


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_resumed_run_is_bitwise_the_uninterrupted_one(trainer: str, nproc: int) -> None:
    suffix = "" if nproc == 1 else "_2proc"
    full = _run(trainer, "ours", f"ours{suffix}", nproc=nproc)
    resumed = _run(trainer, "ours", f"resumed{suffix}", nproc=nproc, resume_from=f"ours{suffix}")
    assert resumed["trained_steps"] == [4, 5, 6] and full["trained_steps"] == [1, 2, 3, 4, 5, 6]
    assert _losses(resumed).keys() == _losses(full).keys()  # steps 1-3 from the checkpoint's trainer_state.json
    for step, loss in _losses(resumed).items():
        assert loss == full["steps"][step]["loss"], step
        assert resumed["steps"][step]["learning_rate"] == full["steps"][step]["learning_rate"], step
    assert _max_diff(full["weights"], resumed["weights"]) == 0.0


@pytest.mark.parametrize("config", ["SFTConfig", "DPOConfig", "RewardConfig"])
def test_a_trl_config_is_rebased_with_every_field_kept(config: str, tmp_path: Path) -> None:
    import trl

    import trainer_ext
    from trainer_ext.trainer.adapt import rebase_arguments
    from trainer_ext.trainer.training_args import TrainingArguments as Ours

    args = getattr(trl, config)(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_length=48, seed=3)
    rebased = rebase_arguments(args)
    assert isinstance(rebased, type(args)) and isinstance(rebased, Ours)
    theirs, ours = args.to_dict(), rebased.to_dict()
    assert {k: ours[k] for k in theirs} == theirs  # every field of TRL's config, with its value
    assert set(ours) - set(theirs) == {f.name for f in fields(Ours)} - {f.name for f in fields(type(args).__mro__[1])}
    with pytest.raises(trainer_ext.ConfigError, match=r"trainer_ext\.adapt\(ItsTrainer\)"):
        trainer_ext.Trainer(model=torch.nn.Linear(2, 2), args=args)


def test_trainer_ext_launch_starts_the_unchanged_trl_script_on_two_processes(tmp_path: Path) -> None:
    """``trainer-ext launch --num_processes 2 script.py`` (docs/trl.md): the run equals the torchrun one."""
    launch = ["-m", "trainer_ext", "launch", "--cpu", "--num_processes", "2"]
    flags = ["--trainer", "sft", "--impl", "ours", "--per_device_train_batch_size", "2"]
    launched = _job(tmp_path / "launched", *flags, launcher=launch)
    torchrun = _run("sft", "ours", "ours_2proc", nproc=2)
    assert launched["world_size"] == 2 and launched["engine"] == "trainer_ext.distributed.engine.Engine"
    assert launched["trained_steps"] == [1, 2, 3, 4, 5, 6]
    assert _losses(launched) == _losses(torchrun)  # the same ranks, data and reduction: bitwise
    weights = load_file(tmp_path / "launched" / "final" / "model.safetensors")
    assert _max_diff(weights, torchrun["weights"]) == 0.0


# what each launched strategy puts in a checkpoint: proof that it, and not DDP, trained
SHARDED_LAUNCHES = {
    "zero3": (["--deepspeed", str(ROOT / "configs" / "deepspeed" / "zero3.json")], "checkpoint-3/global_step3/"),
    "fsdp2": (["--fsdp_config", str(ROOT / "configs" / "fsdp" / "full_shard.yaml")], "checkpoint-3/model_sharded/"),
}


@pytest.mark.parametrize("strategy", [pytest.param("zero3", marks=pytest.mark.deepspeed), "fsdp2"])
def test_dpo_launched_sharded_trains_as_under_ddp(strategy: str, tmp_path: Path) -> None:
    """TRL's DPO (its reference model included) under ``trainer-ext launch --deepspeed zero3.json`` or
    ``--fsdp_config full_shard.yaml`` on 2 processes. On our Trainer ``is_deepspeed_enabled``/``is_fsdp_enabled``
    stay False, so TRL takes its plain reference-model path. The losses and final weights equal the DDP run's."""
    flags, checkpoint_part = SHARDED_LAUNCHES[strategy]
    launch = ["-m", "trainer_ext", "launch", "--cpu", "--num_processes", "2", *flags]
    argv = ["--trainer", "dpo", "--impl", "ours", "--per_device_train_batch_size", "2"]
    launched = _job(tmp_path / strategy, *argv, launcher=launch)
    ddp = _run("dpo", "ours", "ours_2proc", nproc=2)
    assert launched["world_size"] == 2 and launched["trained_steps"] == [1, 2, 3, 4, 5, 6]
    assert any(name.startswith(checkpoint_part) for name in launched["files"]), launched["files"]
    losses = _losses(launched)
    assert losses == pytest.approx(_losses(ddp), rel=1e-5) and losses["6"] < losses["1"]
    weights = load_file(tmp_path / strategy / "final" / "model.safetensors")
    assert _max_diff(weights, ddp["weights"]) < 1e-5


def test_sft_with_a_peft_config_trains_and_saves_the_adapter_only(tmp_path: Path) -> None:
    """TRL's PEFT quick start, ``SFTTrainer(..., peft_config=LoraConfig(...))`` adapted, on 1 process: the LoRA
    weights alone train, the losses move, and the saves hold the adapter only."""
    pytest.importorskip("peft")
    out = tmp_path / "lora"
    result = _job(out, "--trainer", "sft", "--impl", "ours", "--lora")
    assert result["engine"] == "trainer_ext.distributed.engine.Engine"
    assert result["model_type"].startswith("PeftModel"), result["model_type"]  # TRL wrapped it in get_peft_model
    assert result["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in result["trainable"])
    losses = list(_losses(result).values())
    assert len(losses) == 6 and len(set(losses)) > 1, losses  # new batches each step: 6 steps do not show a trend
    for folder in ("final", "checkpoint-3", "checkpoint-6"):
        files = {f.name for f in (out / folder).iterdir()}
        assert {"adapter_model.safetensors", "adapter_config.json"} <= files, (folder, files)
        assert "model.safetensors" not in files, (folder, files)
    adapter = load_file(out / "final" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter), sorted(adapter)[:4]
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]  # zero at the start (peft's init): they trained
    assert lora_b and all(float(v.abs().max()) > 0 for v in lora_b)
