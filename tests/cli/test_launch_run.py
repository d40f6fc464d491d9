"""``trainer-ext launch`` end to end on CPU: 2 processes, two "machines" on loopback, one process, failures.

Two launcher invocations with ``--num_machines 2`` on 127.0.0.1 must give exactly the result of one
machine running 2 processes (same global ranks, same all-reduce order), and the wall times are printed
(run with ``-s`` to see them).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(300)]

JOB = Path(__file__).with_name("rank_job.py")


def environment(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRAINER_EXT_CONFIG_FILE"}
    env.update(HOME=str(home), OMP_NUM_THREADS="1", **extra)
    return env


def launch(*argv: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "trainer_ext", "launch", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[str, str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{err[-5000:]}"
    return out, err


def ranks(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory) -> tuple[Path, float]:
    """2 processes on one machine, with precision and accumulation for the script; (output folder, seconds)."""
    out = tmp_path_factory.mktemp("one_machine")
    env = environment(tmp_path_factory.mktemp("home"))
    start = time.perf_counter()
    options = ["--cpu", "--num_processes", "2", "--mixed_precision", "bf16", "--gradient_accumulation_steps", "3"]
    finish(launch(*options, str(JOB), str(out), env=env))
    return out, time.perf_counter() - start


def test_two_processes_on_one_machine(one_machine):
    out, seconds = one_machine
    infos = ranks(out)
    assert [i["rank"] for i in infos] == [0, 1] and {i["WORLD_SIZE"] for i in infos} == {"2"}
    assert {i["MASTER_ADDR"] for i in infos} == {"127.0.0.1"}
    assert {i["all_reduce"] for i in infos} == {3.0}
    assert {i["ACCELERATE_MIXED_PRECISION"] for i in infos} == {"bf16"}
    assert {i["TRAINER_EXT_GRADIENT_ACCUMULATION_STEPS"] for i in infos} == {"3"}
    assert {i["CUDA_VISIBLE_DEVICES"] for i in infos} == {""}
    print(f"\none machine, 2 processes: {seconds:.1f} s")


def test_two_machines_give_the_same_result_as_one(one_machine, tmp_path, home):
    single_out, single_seconds = one_machine
    out = tmp_path / "two_machines"
    out.mkdir()
    env = environment(home)
    common = ["--cpu", "--num_machines", "2", "--nproc_per_node", "1", "--main_process_ip", "127.0.0.1"]
    common += ["--main_process_port", str(free_port()), "--rdzv_timeout", "120", "--mixed_precision", "bf16"]
    common += ["--gradient_accumulation_steps", "3"]
    start = time.perf_counter()
    machines = [launch(*common, "--machine_rank", str(r), str(JOB), str(out), env=env) for r in (0, 1)]
    for proc in machines:
        finish(proc)
    seconds = time.perf_counter() - start
    infos = ranks(out)
    assert [(i["rank"], i["GROUP_RANK"]) for i in infos] == [(0, "0"), (1, "1")]
    assert {i["all_reduce"] for i in infos} == {3.0} and {i["WORLD_SIZE"] for i in infos} == {"2"}
    two, one = torch.load(out / "weights.pt"), torch.load(single_out / "weights.pt")
    assert all(torch.equal(two[k], one[k]) for k in one)  # same ranks, same reduction: bitwise equal
    print(f"\ntwo machines x 1 process: {seconds:.1f} s; one machine x 2 processes: {single_seconds:.1f} s")


def test_one_process_runs_directly_without_launcher_variables(one_machine, tmp_path, home):
    out = tmp_path / "single"
    out.mkdir()
    env = environment(home, RANK="5", WORLD_SIZE="9", MASTER_ADDR="10.9.9.9", MASTER_PORT="1")
    _, err = finish(launch("--cpu", str(JOB), str(out), env=env))
    (info,) = ranks(out)
    assert (info["RANK"], info["WORLD_SIZE"], info["MASTER_ADDR"], info["world_size"]) == (None, None, None, 1)
    assert "1 process on this machine" in err
    one, ddp = torch.load(out / "weights.pt"), torch.load(one_machine[0] / "weights.pt")
    assert all(torch.allclose(one[k], ddp[k], atol=1e-6) for k in one)  # whole batch vs mean of 2 halves


def test_a_failing_rank_gives_its_exit_code_and_a_summary(tmp_path, home):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    proc = launch("--cpu", "--num_processes", "2", str(script), env=environment(home))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3
    assert "error: rank 1 (local rank 1," in err and "exit code 3" in err


def test_a_machine_that_never_comes_is_diagnosed(tmp_path, home):
    options = ["--cpu", "--num_machines", "2", "--main_process_ip", "127.0.0.1", "--rdzv_timeout", "2"]
    proc = launch(*options, "--main_process_port", str(free_port()), str(JOB), str(tmp_path), env=environment(home))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "error: the machines did not meet at 127.0.0.1:" in err and "1/2 clients joined" in err


def test_one_process_is_restarted_after_a_crash(tmp_path, home):
    """--max_restarts on one process: torchrun's agent (loopback) starts it again, and the run ends with 0."""
    script = tmp_path / "crash_once.py"
    script.write_text(
        "import os, pathlib, sys\n"
        "attempt = os.environ.get('TORCHELASTIC_RESTART_COUNT', 'none')\n"
        "pathlib.Path(sys.argv[1], f'attempt-{attempt}').write_text(os.environ.get('MASTER_ADDR', '-'))\n"
        "sys.exit(0 if attempt not in ('none', '0') else 1)  # the first attempt crashes\n"
    )
    proc = launch("--cpu", "--max_restarts", "1", str(script), str(tmp_path), env=environment(home))
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    attempts = {p.name: p.read_text() for p in tmp_path.glob("attempt-*")}
    assert attempts == {"attempt-0": "127.0.0.1", "attempt-1": "127.0.0.1"}


@pytest.mark.deepspeed
def test_deepspeed_given_to_the_launcher_reaches_an_unchanged_script(tmp_path, home):
    """`trainer-ext launch --deepspeed FILE script.py` as `accelerate launch --use_deepspeed`: the script's
    Accelerator() and TrainingArguments name no DeepSpeed config and train with the launch's."""
    pytest.importorskip("deepspeed")
    config = {
        "zero_optimization": {"stage": 2},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"},
        },
    }
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(config))
    out = tmp_path / "out"
    out.mkdir()
    env = environment(home, DS_ACCELERATOR="cpu")
    job = Path(__file__).with_name("ds_launch_job.py")
    finish(launch("--cpu", "--num_processes", "2", "--deepspeed", str(ds), str(job), str(out), env=env))
    infos = ranks(out)
    assert [i["rank"] for i in infos] == [0, 1] and {i["world"] for i in infos} == {2}
    for info in infos:
        assert info["distributed_type"] == "DEEPSPEED" and info["zero_stage"] == 2
        assert info["variable"] == str(ds) and info["trainer_arguments_deepspeed"] == str(ds)
        assert info["trainer_arguments_stage"] == 2
        # 8 batches of 4 over 2 ranks: 4 steps; DeepSpeed's WarmupDecayLR from DummyScheduler(total 8 / 2, warm-up 2)
        assert info["lrs"] == pytest.approx([0.0, 0.05, 0.05, 0.025])
    assert infos[0]["losses"] == infos[1]["losses"]


def test_fsdp_given_to_the_launcher_reaches_an_unchanged_script(tmp_path, home):
    """`trainer-ext launch --fsdp_config FILE script.py` as `accelerate launch --use_fsdp`: the script's Accelerator()
    and TrainingArguments name no FSDP settings and train with the launch's; the sharded run gives the DDP run's
    losses and weights."""
    env = environment(home)
    job = Path(__file__).with_name("fsdp_launch_job.py")
    preset = Path(__file__).resolve().parents[2] / "configs" / "fsdp" / "shard_grad_op.yaml"
    runs = {}
    for name, extra in (("fsdp", ["--fsdp_config", str(preset)]), ("ddp", [])):
        out = tmp_path / name
        out.mkdir()
        finish(launch("--cpu", "--num_processes", "2", *extra, str(job), str(out), env=env))
        runs[name] = ranks(out)
    for info in runs["fsdp"]:
        assert info["distributed_type"] == "FSDP" and info["world"] == 2
        assert info["plugin"] == {"reshard_after_forward": False, "state_dict_type": "SHARDED_STATE_DICT"}
        assert info["local_rows"] == 4  # the first Linear's 8 rows, sharded over 2 ranks
        assert info["trainer_arguments_fsdp"]["reshard_after_forward"] is False
    for info in runs["ddp"]:
        assert info["distributed_type"] == "MULTI_CPU" and info["plugin"] is None and info["local_rows"] == 8
        assert info["trainer_arguments_fsdp"] is None
    sharded, replicated = runs["fsdp"][0], runs["ddp"][0]
    assert sharded["losses"] == pytest.approx(replicated["losses"], rel=1e-5)
    assert sharded["weights"].keys() == replicated["weights"].keys()
    for key, values in sharded["weights"].items():
        assert values == pytest.approx(replicated["weights"][key], rel=1e-5, abs=1e-6), key


SAVE_ON_SIGTERM = """
import os, signal, sys, time
from pathlib import Path
out, handle = Path(sys.argv[1]), sys.argv[2] == "save"
stop = []
if handle:
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
rank = int(os.environ.get("RANK", "0"))
if "WORLD_SIZE" in os.environ:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
(out / f"ready{rank}").write_text("")
deadline = time.monotonic() + 60  # bounded: a rank the signal never reaches ends by itself
while not stop and time.monotonic() < deadline:
    time.sleep(0.05)
(out / f"saved{rank}").write_text("")  # what a preemption save does, then its exit code
sys.exit(75 if stop else 1)
"""


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize(("ranks_do", "code"), [("save", 75), ("die", 143)])
def test_sigterm_to_the_launcher_gives_the_ranks_exit_code(tmp_path, home, processes, ranks_do, code):
    """SIGTERM to `trainer-ext launch` alone (`kill PID`, a scheduler): the ranks get it (torchrun passes it on, or
    the launcher does for one process); when they save and exit 75 the launcher exits 75, which
    scripts/slurm.sbatch requeues on; ranks that die of it give 128 + 15."""
    script = tmp_path / "save_on_sigterm.py"
    script.write_text(SAVE_ON_SIGTERM)
    proc = launch(
        "--cpu", "--num_processes", str(processes), str(script), str(tmp_path), ranks_do, env=environment(home)
    )
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{rank}").exists() for rank in range(processes)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    if ranks_do == "save":
        assert sorted(p.name for p in tmp_path.glob("saved*")) == [f"saved{rank}" for rank in range(processes)]
