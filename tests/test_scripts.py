"""End to end: the launch scripts run the same `trainer-ext train` on 1 process, 2 DDP ranks and 2 "machines".

Every script goes through `trainer-ext launch`; the launch config is pinned to an empty file so a config in
the real home directory never changes what the tests run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["--max_steps", "30", "--learning_rate", "2e-3", "--seed", "7"]


@pytest.fixture(scope="module")
def launch_config(tmp_path_factory) -> str:
    """An empty launch config: only what the scripts and tests say counts."""
    path = tmp_path_factory.mktemp("launch") / "empty.yaml"
    path.write_text("")
    return str(path)


def _environment(launch_config: str, **env: str) -> dict[str, str]:
    environ = dict(os.environ, OMP_NUM_THREADS="1", TRAINER_EXT_CONFIG_FILE=launch_config, **env)
    environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), environ.get("PATH", "")])
    return environ


def _start(script: str, *args: str, launch_config: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", str(ROOT / "scripts" / script), *args],
        cwd=ROOT,
        env=_environment(launch_config, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait(proc: subprocess.Popen, script: str) -> str:
    out, err = proc.communicate(timeout=500)
    assert proc.returncode == 0, f"{script} failed:\n{out[-3000:]}\n{err[-5000:]}"
    return out


def _run(script: str, *args: str, launch_config: str, **env: str) -> str:
    return _wait(_start(script, *args, launch_config=launch_config, **env), script)


def _eval_metrics(output_dir: Path) -> dict:
    return json.loads((output_dir / "eval_results.json").read_text())


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, launch_config) -> tuple[Path, float]:
    """scripts/multi_cpu.sh: the default job on 2 gloo ranks of one machine; (output folder, seconds)."""
    out = tmp_path_factory.mktemp("ddp")
    start = time.perf_counter()
    _run(
        "multi_cpu.sh",
        *COMMON,
        "--per_device_train_batch_size",
        "16",
        "--output_dir",
        str(out),
        NPROC="2",
        launch_config=launch_config,
    )
    return out, time.perf_counter() - start


def test_cpu_script_runs_the_default_job(tmp_path: Path, launch_config) -> None:
    out = tmp_path / "one"
    _run("cpu.sh", "--max_steps", "30", "--output_dir", str(out), launch_config=launch_config)
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert not list(out.glob("checkpoint-*"))


def test_multi_cpu_script_runs_the_same_job_on_two_ranks(tmp_path: Path, ddp_run, launch_config) -> None:
    """Same command, 2 gloo ranks: one saved model, and the same accuracy as one process on batch 2x."""
    ddp, single = ddp_run[0], tmp_path / "single"
    _run(
        "cpu.sh",
        *COMMON,
        "--per_device_train_batch_size",
        "32",
        "--output_dir",
        str(single),
        launch_config=launch_config,
    )
    assert (ddp / "model.safetensors").exists()
    a, b = _eval_metrics(ddp), _eval_metrics(single)
    assert a["eval_samples"] == b["eval_samples"] == 400
    assert abs(a["eval_accuracy"] - b["eval_accuracy"]) <= 0.01


@pytest.mark.distributed
def test_multi_node_script_on_two_machines_equals_one_machine(tmp_path: Path, ddp_run, launch_config) -> None:
    """scripts/multi_node.sh started twice (NNODES=2, c10d on 127.0.0.1): the weights of multi_cpu.sh's run."""
    out = tmp_path / "two_machines"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    env = dict(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NPROC_PER_NODE="1", DEVICE="cpu")
    args = [*COMMON, "--per_device_train_batch_size", "16", "--output_dir", str(out)]
    start = time.perf_counter()
    machines = [_start("multi_node.sh", *args, launch_config=launch_config, **env) for _ in range(2)]
    for proc in machines:
        _wait(proc, "multi_node.sh")
    seconds = time.perf_counter() - start
    one_machine, one_seconds = ddp_run
    two, one = load_file(out / "model.safetensors"), load_file(one_machine / "model.safetensors")
    assert two.keys() == one.keys()
    assert all(torch.allclose(two[k], one[k], atol=1e-6) for k in one)
    assert _eval_metrics(out)["eval_accuracy"] == _eval_metrics(one_machine)["eval_accuracy"]
    print(f"\ntrain job: 2 machines x 1 process {seconds:.1f} s; 1 machine x 2 processes {one_seconds:.1f} s")


@pytest.mark.distributed
@pytest.mark.parametrize("script", ["fsdp.sh", pytest.param("deepspeed.sh", marks=pytest.mark.deepspeed)])
def test_sharded_scripts_train_the_same_job_as_ddp(tmp_path: Path, ddp_run, launch_config, script: str) -> None:
    """scripts/fsdp.sh (FSDP2, full_shard preset) and scripts/deepspeed.sh (ZeRO-2 preset) on 2 CPU ranks: the
    same command as multi_cpu.sh ends with DDP's weights (fp32; measured: FSDP 0.0, DeepSpeed 4e-8)."""
    out = tmp_path / "sharded"
    args = [*COMMON, "--per_device_train_batch_size", "16", "--output_dir", str(out)]
    _run(script, *args, DEVICE="cpu", NPROC="2", launch_config=launch_config)
    sharded, ddp = load_file(out / "model.safetensors"), load_file(ddp_run[0] / "model.safetensors")
    assert sharded.keys() == ddp.keys()
    assert max(float((sharded[k].float() - ddp[k].float()).abs().max()) for k in ddp) < 1e-5
    assert _eval_metrics(out)["eval_accuracy"] == _eval_metrics(ddp_run[0])["eval_accuracy"]


@pytest.mark.deepspeed
@pytest.mark.distributed
def test_an_accelerate_deepspeed_config_with_inline_keys_trains_the_same_job(tmp_path: Path, ddp_run) -> None:
    """The file `accelerate config` writes for DeepSpeed (zero_stage, offload devices inline, no JSON file) goes
    to `trainer-ext launch --config_file` as it is: ZeRO-2 on 2 CPU ranks ends with DDP's weights."""
    accelerate_file = tmp_path / "accelerate_ds.yaml"
    accelerate_file.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
        "  gradient_accumulation_steps: 1\n  offload_optimizer_device: none\n  offload_param_device: none\n"
        "  zero3_init_flag: false\n  zero_stage: 2\nmachine_rank: 0\nmain_training_function: main\n"
        "mixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\nuse_cpu: true\n"
    )
    out = tmp_path / "zero2"
    args = [*COMMON, "--per_device_train_batch_size", "16", "--output_dir", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "trainer_ext", "launch", "--config_file", str(accelerate_file), "train", *args],
        cwd=ROOT,
        env=_environment(str(accelerate_file), DS_ACCELERATOR="cpu"),
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "ignored accelerate keys" in proc.stderr and "deepspeed_config.zero3_init_flag" in proc.stderr
    zero2, ddp = load_file(out / "model.safetensors"), load_file(ddp_run[0] / "model.safetensors")
    assert zero2.keys() == ddp.keys()
    assert max(float((zero2[k].float() - ddp[k].float()).abs().max()) for k in ddp) < 1e-5


# --- What the scripts hand to the launcher: stand-ins for trainer-ext, srun and scontrol, or the real launcher's
# --- dry run. Nothing trains here.

RECORD_ARGV = '#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$FAKE_LOG/argv"\n'
# srun: the task once per node, one after another, with that node's SLURM_NODEID; FAKE_SRUN_STATUS: only exit so
FAKE_SRUN = """#!/usr/bin/env bash
options=()
while [[ "$1" == --* ]]; do options+=("$1"); shift; done
echo "${options[*]}" > "$FAKE_LOG/srun_options"
if [[ -n "${FAKE_SRUN_STATUS:-}" ]]; then exit "$FAKE_SRUN_STATUS"; fi
status=0
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node "$@" > "$FAKE_LOG/node$node.out" 2> "$FAKE_LOG/node$node.err" || status=$?
done
exit "$status"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG/scontrol"
if [[ "$1 $2" == "show hostnames" ]]; then printf 'node01\\nnode02\\n'; fi
"""


def _stand_ins(tmp_path: Path, launch_config: str, **programs: str) -> dict[str, str]:
    """An environment whose PATH finds ``programs`` (name -> bash text) first; they write under $FAKE_LOG."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, text in programs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = _environment(launch_config, FAKE_LOG=str(log))
    env["PATH"] = os.pathsep.join([str(bin_dir), env["PATH"]])
    return env


def _script(name: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = ["bash", str(ROOT / "scripts" / name), *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "scripts").iterdir()))
def test_every_script_is_valid_bash(script: str) -> None:
    proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("script", "env", "launch_options"),
    [
        ("single_gpu.sh", {}, ["--num_machines", "1", "--num_processes", "1", "--gpu_ids", "0"]),
        ("single_gpu.sh", {"GPU": "3", "DRY_RUN": "1"}, ["--num_machines", "1", "--num_processes", "1"]),
        ("multi_gpu.sh", {}, ["--num_machines", "1", "--gpu_ids", "all"]),
        ("multi_gpu.sh", {"GPUS": "0,1", "NPROC": "1", "DRY_RUN": "1"}, ["--num_machines", "1", "--gpu_ids", "0,1"]),
    ],
)
def test_gpu_scripts_build_the_launch_command(tmp_path: Path, launch_config, script, env, launch_options) -> None:
    """The argv single_gpu.sh and multi_gpu.sh give `trainer-ext` (a stand-in that records it)."""
    environ = _stand_ins(tmp_path, launch_config, **{"trainer-ext": RECORD_ARGV})
    proc = _script(script, "--max_steps", "3", "--bf16", env={**environ, **env})
    assert proc.returncode == 0, proc.stderr
    expected = ["launch", *launch_options]
    if "GPU" in env:
        expected += ["--gpu_ids", env["GPU"]]
    if "NPROC" in env:
        expected += ["--nproc_per_node", env["NPROC"]]
    if "DRY_RUN" in env:
        expected.append("--dry_run")
    expected += ["train", "--max_steps", "3", "--bf16"]
    assert (tmp_path / "log" / "argv").read_text().splitlines() == expected


@pytest.mark.parametrize("script", ["single_gpu.sh", "multi_gpu.sh"])
def test_gpu_scripts_without_a_gpu_say_so_before_starting(launch_config, script) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU (see the gpu test below)")
    proc = _script(script, "--max_steps", "3", env=_environment(launch_config, DRY_RUN="1"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "GPUs are asked for" in proc.stderr and "this machine has no CUDA GPU that torch can use" in proc.stderr


@pytest.mark.gpu
def test_gpu_scripts_dry_run_on_a_gpu_machine(launch_config) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    single = _script("single_gpu.sh", "--max_steps", "3", env=_environment(launch_config, DRY_RUN="1"))
    assert single.returncode == 0, single.stderr
    assert f"CUDA_VISIBLE_DEVICES=0 {sys.executable} -u -m trainer_ext train --max_steps 3" in single.stdout
    multi = _script("multi_gpu.sh", "--max_steps", "3", env=_environment(launch_config, DRY_RUN="1"))
    assert multi.returncode == 0, multi.stderr
    count = torch.cuda.device_count()
    if count == 1:
        assert f"{sys.executable} -u -m trainer_ext train --max_steps 3" in multi.stdout
    else:
        assert f"--nproc_per_node {count}" in multi.stdout and "-m torch.distributed.run" in multi.stdout


def test_fsdp_script_dry_run_shows_the_preset_settings(launch_config) -> None:
    proc = _script("fsdp.sh", "--max_steps", "3", env=_environment(launch_config, DEVICE="cpu", DRY_RUN="1"))
    assert proc.returncode == 0, proc.stderr
    assert "FSDP2 settings from command line --fsdp_config, as train will apply them (fully_shard):" in proc.stdout
    assert "--fsdp full_shard --fsdp_config" in proc.stdout.split("command:")[1]


EXAMPLE = ["--config", str(ROOT / "configs" / "examples" / "causal_lm.yaml")]


@pytest.mark.parametrize(
    ("script", "env", "args", "launch_options"),
    [
        ("tp.sh", {}, [], ["--num_processes", "2", "--tp_size", "2", "--gpu_ids", "all"]),
        ("tp.sh", {"TP": "4", "DEVICE": "cpu", "DRY_RUN": "1"}, [], ["--num_processes", "4", "--tp_size", "4", "--cpu"]),
        ("tp.sh", {"GPUS": "0,1"}, ["--model_config", "tiny-llama"], ["--num_processes", "2", "--tp_size", "2", "--gpu_ids", "0,1"]),
        ("fsdp_tp.sh", {}, [], ["--num_processes", "4", "--dp_shard_size", "2", "--tp_size", "2", "--gpu_ids", "all"]),
        (
            "fsdp_tp.sh",
            {"DP_REPLICATE": "2", "DP_SHARD": "2", "TP": "2", "FSDP_CONFIG": "configs/fsdp/full_shard.yaml", "DEVICE": "cpu"},
            ["--config=my.yaml"],
            ["--num_processes", "8", "--dp_shard_size", "2", "--tp_size", "2", "--dp_replicate_size", "2",
             "--fsdp_config", "configs/fsdp/full_shard.yaml", "--cpu"],
        ),
        ("cp.sh", {}, [], ["--num_processes", "2", "--cp_size", "2", "--gpu_ids", "all"]),
        (
            "cp.sh",
            {"CP": "4", "DP_SHARD": "2", "CP_BACKEND": "all_gather", "DEVICE": "cpu", "DRY_RUN": "1"},
            ["--task", "causal-lm"],
            ["--num_processes", "8", "--cp_size", "4", "--dp_shard_size", "2", "--cp_backend", "all_gather", "--cpu"],
        ),
        ("pp.sh", {}, [], ["--num_processes", "2", "--pp_size", "2", "--gpu_ids", "all"]),
        (
            "pp.sh",
            {"PP": "4", "DP_SHARD": "2", "PP_SCHEDULE": "interleaved_1f1b", "PP_MICROBATCHES": "8", "DEVICE": "cpu",
             "DRY_RUN": "1"},
            ["--model_config=untied.json"],
            ["--num_processes", "8", "--pp_size", "4", "--dp_shard_size", "2", "--pp_schedule", "interleaved_1f1b",
             "--pp_microbatches", "8", "--cpu"],
        ),
        ("pp.sh", {"GPUS": "0,1"}, ["--config", "my.yaml"], ["--num_processes", "2", "--pp_size", "2", "--gpu_ids", "0,1"]),
    ],
)  # fmt: skip
def test_tensor_parallel_scripts_build_the_launch_command(
    tmp_path: Path, launch_config, script, env, args, launch_options
) -> None:
    """The argv tp.sh, fsdp_tp.sh, cp.sh and pp.sh give `trainer-ext`: the sizes, the process count they multiply to,
    and the causal-LM example as the job unless the arguments name a config, a model or a task (pp.sh: with the
    untied preset the pipeline splits)."""
    environ = _stand_ins(tmp_path, launch_config, **{"trainer-ext": RECORD_ARGV})
    proc = _script(script, *args, "--max_steps", "3", env={**environ, **env})
    assert proc.returncode == 0, proc.stderr
    expected = ["launch", "--num_machines", "1", *launch_options, *(["--dry_run"] if "DRY_RUN" in env else [])]
    example = [*EXAMPLE, "--model_config", "tiny-llama-untied"] if script == "pp.sh" else EXAMPLE
    expected += ["train", *(args or example), "--max_steps", "3"]
    assert (tmp_path / "log" / "argv").read_text().splitlines() == expected


@pytest.mark.parametrize(
    ("script", "variable"),
    [
        ("tp.sh", "TP"),
        ("fsdp_tp.sh", "DP_SHARD"),
        ("fsdp_tp.sh", "TP"),
        ("cp.sh", "CP"),
        ("cp.sh", "DP_SHARD"),
        ("pp.sh", "PP"),
        ("pp.sh", "DP_SHARD"),
    ],
)
def test_tensor_parallel_scripts_refuse_a_size_that_is_no_count(
    tmp_path: Path, launch_config, script, variable
) -> None:
    environ = _stand_ins(tmp_path, launch_config, **{"trainer-ext": RECORD_ARGV})
    proc = _script(script, "--max_steps", "3", env={**environ, variable: "two"})
    assert proc.returncode == 2 and not (tmp_path / "log" / "argv").exists()
    assert proc.stderr.strip() == f"{variable}=two is not a process count: set {variable} to a whole number such as 2"


def test_fsdp_tp_script_dry_run_shows_the_mesh(launch_config) -> None:
    proc = _script("fsdp_tp.sh", "--max_steps", "3", env=_environment(launch_config, DEVICE="cpu", DRY_RUN="1"))
    assert proc.returncode == 0, proc.stderr
    assert "mesh: dp_shard 2 x tp 2 (2 data-parallel ranks;" in proc.stdout
    command = proc.stdout.split("command:")[1]
    assert "PARALLELISM_CONFIG_TP_SIZE=2" in command and "--nproc_per_node 4" in command
    assert command.strip().endswith("--max_steps 3 --use_cpu --dp_shard_size 2 --tp_size 2")


def test_cp_script_dry_run_shows_the_mesh_and_a_bert_job_is_refused(launch_config) -> None:
    proc = _script("cp.sh", "--max_steps", "3", env=_environment(launch_config, DEVICE="cpu", DRY_RUN="1"))
    assert proc.returncode == 0, proc.stderr
    assert "mesh: cp 2 (1 data-parallel rank; context-parallel attention all_gather (auto);" in proc.stdout
    command = proc.stdout.split("command:")[1]
    assert "PARALLELISM_CONFIG_CP_SIZE=2" in command and "--nproc_per_node 2" in command
    assert command.strip().endswith("--max_steps 3 --use_cpu --cp_size 2")
    proc = _script("cp.sh", "--task", "sequence-classification", env=_environment(launch_config, DEVICE="cpu"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == ""
    assert "cp_size 2: context parallelism splits causal language models' sequences" in proc.stderr


def test_pp_script_dry_run_shows_the_mesh_and_a_tied_model_is_refused(launch_config) -> None:
    """The untied preset splits into 2 stages; the example's own tiny-llama (tied) is refused before any process, and
    so are a schedule and a microbatch count launch does not know."""
    proc = _script("pp.sh", "--max_steps", "3", env=_environment(launch_config, DEVICE="cpu", DRY_RUN="1"))
    assert proc.returncode == 0, proc.stderr
    assert "mesh: pp 2 (1 data-parallel rank; pipeline 2 stages, 1f1b, 2 microbatches, bubble 33%;" in proc.stdout
    command = proc.stdout.split("command:")[1]
    assert "PARALLELISM_CONFIG_PP_SIZE=2" in command and "--nproc_per_node 2" in command
    assert command.strip().endswith("--model_config tiny-llama-untied --max_steps 3 --use_cpu --pp_size 2")
    env = _environment(launch_config, DEVICE="cpu", DRY_RUN="1", PP_SCHEDULE="interleaved_1f1b", PP_MICROBATCHES="4")
    proc = _script("pp.sh", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "mesh: pp 2 (1 data-parallel rank; pipeline 4 stages on 2 ranks, interleaved_1f1b, 4 microbatches," in (
        proc.stdout
    )
    proc = _script("pp.sh", *EXAMPLE, env=_environment(launch_config, DEVICE="cpu"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == ""
    assert "the preset tiny-llama: pipeline of 2 stages: LlamaForCausalLM ties lm_head" in proc.stderr
    for variable, value, message in (
        ("PP_SCHEDULE", "zigzag", "'zigzag' is not one of 1f1b, gpipe,"),
        ("PP_MICROBATCHES", "0", "--pp_microbatches: 0 must be between 1 and"),
    ):
        proc = _script("pp.sh", env=_environment(launch_config, DEVICE="cpu", **{variable: value}))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == ""
        assert message in proc.stderr


# a fine-tuning job on the example's corpus; the model comes from --model_name_or_path
FINE_TUNE = [
    "--task",
    "causal-lm",
    "--max_seq_length",
    "128",
    *COMMON,
    "--save_strategy",
    "no",
    "--eval_strategy",
    "no",
]


@pytest.fixture(scope="module")
def lm_to_fine_tune(tmp_path_factory, launch_config) -> Path:
    """The example's tiny Llama after one step, its vocabulary (91 words, tied head) padded to a multiple of 4: tensor
    parallelism splits the embeddings and the head by vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first, base = tmp_path_factory.mktemp("lm_first"), tmp_path_factory.mktemp("lm_base")
    args = [*EXAMPLE, "--max_steps", "1", "--save_strategy", "no", "--eval_strategy", "no", "--output_dir", str(first)]
    _run("cpu.sh", *args, launch_config=launch_config)
    tokenizer, model = AutoTokenizer.from_pretrained(first), AutoModelForCausalLM.from_pretrained(first)
    torch.manual_seed(0)  # the new row is drawn at random: the same model in every run
    model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=4)
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    return base


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("script", "reference", "batch"),
    [("tp.sh", "cpu.sh", "32"), ("fsdp_tp.sh", "multi_cpu.sh", "16"), ("cp.sh", "cpu.sh", "32")],
)
def test_tensor_parallel_scripts_fine_tune_as_data_parallelism(
    tmp_path: Path, lm_to_fine_tune, launch_config, script: str, reference: str, batch: str
) -> None:
    """tp.sh (tp 2: 2 CPU processes share each batch of 32) ends with the weights of one process on that batch;
    fsdp_tp.sh (dp_shard 2 x tp 2: 4 processes, 2 batches of 16) with those of DDP on 2 ranks, which reads the
    batches in the same order; cp.sh (cp 2: 2 CPU processes share each batch of 32, each holding half of every
    sequence) with one process's too. float32, 30 AdamW steps at 2e-3: the row-wise sums of TP add in another order,
    and Adam's step divides such differences by the root of small second moments; measured 4.2e-5 and 4.6e-5 on this
    padded row (0.7e-6 to 1.1e-6 on three others); cp.sh 5.8e-5 (attention over gathered keys sums in another order),
    eval loss 2.4e-7."""
    args = [*FINE_TUNE, "--model_name_or_path", str(lm_to_fine_tune), "--per_device_train_batch_size", batch]
    single, parallel = tmp_path / "reference", tmp_path / "parallel"
    _run(reference, *args, "--output_dir", str(single), NPROC="2", launch_config=launch_config)
    _run(script, *args, "--output_dir", str(parallel), DEVICE="cpu", launch_config=launch_config)
    got, expected = load_file(parallel / "model.safetensors"), load_file(single / "model.safetensors")
    assert got.keys() == expected.keys()
    assert max(float((got[k] - expected[k]).abs().max()) for k in expected) < 1e-4
    assert abs(_eval_metrics(parallel)["eval_loss"] - _eval_metrics(single)["eval_loss"]) < 1e-5


SLURM = {"SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242", "CUDA_VISIBLE_DEVICES": ""}


def test_slurm_script_launches_every_node_with_its_rank(tmp_path: Path, launch_config) -> None:
    """Fake srun runs the task for nodes 0 and 1; the real launcher's dry run shows what each node would start."""
    env = _stand_ins(tmp_path, launch_config, srun=FAKE_SRUN, scontrol=FAKE_SCONTROL)
    env.update(SLURM, MASTER_PORT="29611", NPROC_PER_NODE="2", DRY_RUN="1")
    proc = _script("slurm.sbatch", "--max_steps", "3", env=env)
    log = tmp_path / "log"
    assert proc.returncode == 0, proc.stderr + "".join(p.read_text() for p in log.glob("node*.err"))
    assert (log / "scontrol").read_text().splitlines() == ["show hostnames node[01-02]"]  # no requeue
    assert (log / "srun_options").read_text().split() == ["--kill-on-bad-exit=1"]
    for node in (0, 1):
        out = (log / f"node{node}.out").read_text()
        rows = {line.split()[0]: line.split()[1:] for line in out.split("command:")[0].splitlines()[2:]}
        assert rows["num_machines"][0] == "2" and rows["machine_rank"][:3] == [str(node), "command", "line"]
        assert rows["main_process_ip"][0] == "node01" and rows["main_process_port"][0] == "29611"
        command = out.split("command:\n")[1].strip()
        assert "-m torch.distributed.run --nnodes 2 --nproc_per_node 2 --rdzv_backend static" in command
        assert f"--node_rank {node} --master_addr node01 --master_port 29611" in command
        assert command.endswith("-m trainer_ext train --resume_from_checkpoint auto --max_steps 3")


@pytest.mark.parametrize(("status", "requeued"), [(75, True), (138, True), (1, False), (0, False)])
def test_slurm_script_requeues_after_a_preemption_save(tmp_path: Path, launch_config, status, requeued) -> None:
    """Exit 75 (the ranks saved after SIGUSR1/SIGTERM) or 138 (the launcher got SIGUSR1): requeue; else not."""
    env = _stand_ins(tmp_path, launch_config, srun=FAKE_SRUN, scontrol=FAKE_SCONTROL)
    env.update(SLURM, FAKE_SRUN_STATUS=str(status))
    proc = _script("slurm.sbatch", "--max_steps", "3", env=env)
    assert proc.returncode == status
    calls = (tmp_path / "log" / "scontrol").read_text().splitlines()
    assert calls[1:] == (["requeue 4242"] if requeued else [])
    assert ("preempted: checkpoint saved, requeueing job 4242" in proc.stdout) == requeued
