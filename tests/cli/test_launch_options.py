"""``trainer-ext launch`` without starting processes: options, precedence, the command it builds, bad input."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_ext.cli.launch import build_parser, prepare, split_argv
from trainer_ext.cli.launch.handoff import train_flags_set
from trainer_ext.cli.main import main
from trainer_ext.errors import ConfigError


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "job.py"
    path.write_text("print('hello')\n")
    return str(path)


def plan_of(*argv: str):
    settings, plan, _ = prepare(list(argv))
    return settings, plan


def error_of(capsys, *argv: str) -> str:
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_split_finds_options_target_and_its_arguments(script):
    parser = build_parser()
    options, target = split_argv(["--num-processes", "2", "--cpu", script, "--lr", "3", "-m", "x"], parser)
    assert options == ["--num_processes", "2", "--cpu"]
    assert (target.kind, target.name, target.args) == ("script", script, ["--lr", "3", "-m", "x"])
    options, target = split_argv(["--nnodes=2", "-m", "pkg.mod", "--flag"], parser)
    assert options == ["--nnodes=2"] and (target.kind, target.name, target.args) == ("module", "pkg.mod", ["--flag"])
    assert split_argv(["train", "--max_steps", "3"], parser)[1].python_argv() == ["-m", "trainer_ext", "train"] + [
        "--max_steps",
        "3",
    ]


def test_dash_and_underscore_spellings_and_torchrun_aliases_are_the_same(gpus, script):
    a, _ = plan_of("--num-machines", "2", "--machine-rank", "1", "--main-process-ip", "10.0.0.1", script)
    b, _ = plan_of("--nnodes", "2", "--node_rank", "1", "--main_process_ip=10.0.0.1", script)
    for name in ("num_machines", "machine_rank", "main_process_ip", "num_processes"):
        assert a[name] == b[name]
    assert b.sources["machine_rank"] == "command line --node_rank"


def test_one_process_runs_directly_without_rendezvous(gpus, script):
    settings, plan = plan_of(script, "--x", "1")
    assert plan.torchrun_args is None
    assert plan.command == [sys.executable, "-u", script, "--x", "1"]
    assert settings["main_process_ip"] is None and "no rendezvous" in settings.sources["main_process_ip"]


def test_one_machine_binds_the_rendezvous_to_loopback_on_a_free_port(gpus, script):
    _, plan = plan_of("--num_processes", "2", script)
    args = plan.torchrun_args
    assert args[args.index("--rdzv_endpoint") + 1] == "127.0.0.1:0"
    assert args[args.index("--local_addr") + 1] == "127.0.0.1"
    assert args[args.index("--nproc_per_node") + 1] == "2" and args[-1] == script
    assert plan.command[:3] == [sys.executable, "-m", "torch.distributed.run"]


def test_several_machines_meet_at_the_main_address(gpus, script):
    _, static = plan_of("--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.0.0.1", script)
    a = static.torchrun_args
    assert a[a.index("--rdzv_backend") + 1] == "static" and a[a.index("--node_rank") + 1] == "1"
    assert a[a.index("--master_addr") + 1] == "10.0.0.1" and a[a.index("--master_port") + 1] == "29500"
    assert "--local_addr" not in a
    _, c10d = plan_of("--nnodes", "2", "--main_process_ip", "fd00::1", "--rdzv_backend", "c10d", script)
    b = c10d.torchrun_args
    assert b[b.index("--rdzv_endpoint") + 1] == "[fd00::1]:29500"


def test_a_public_main_address_gets_a_warning(gpus, script):
    settings, _ = plan_of("--num_machines", "2", "--main_process_ip", "8.8.8.8", script)
    assert any("public address" in note and "no authentication" in note for note in settings.notes)
    assert not any(
        "public" in note for note in plan_of("--nnodes", "2", "--main_process_ip", "10.0.0.1", script)[0].notes
    )


def test_num_processes_is_the_total_and_nproc_per_node_is_per_machine(gpus, script):
    s, _ = plan_of("--num_processes", "4", "--num_machines", "2", "--main_process_ip", "h", script)
    assert (s["num_processes"], s["nproc_per_node"]) == (4, 2)
    s, _ = plan_of("--nproc_per_node", "4", "--num_machines", "2", "--main_process_ip", "h", script)
    assert (s["num_processes"], s["nproc_per_node"]) == (8, 4)


def test_train_gets_precision_and_accumulation_as_flags(gpus):
    _, plan = plan_of(
        "--num_processes", "2", "--mixed_precision", "bf16", "--gradient_accumulation_steps", "4", "train"
    )
    assert plan.command[-4:] == ["train", "--bf16", "--gradient_accumulation_steps", "4"]
    assert "ACCELERATE_MIXED_PRECISION" not in plan.env


def test_the_users_train_flags_win_and_the_dry_run_says_so(gpus, tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("gradient_accumulation_steps: 8\n")
    argv = ["--mixed_precision", "bf16", "--gradient_accumulation_steps", "4", "--cpu", "--dry_run"]
    assert main(["launch", *argv, "train", "--fp16=false", "--config", str(job)]) == 0
    out = capsys.readouterr().out
    command = out.split("command:")[1]
    assert "--bf16" not in command and "--gradient_accumulation_steps" not in command and "--use_cpu" in command
    assert "already set --fp16 (your train flags win)" in out
    assert "already set --gradient_accumulation_steps" in out
    assert {"fp16", "config", "gradient_accumulation_steps"} <= train_flags_set(["--fp16=false", "--config", str(job)])


def test_a_script_gets_environment_variables(gpus, script):
    _, plan = plan_of("--mixed_precision", "bf16", "--gradient_accumulation_steps", "3", "--cpu", script)
    assert plan.env == {
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "TRAINER_EXT_GRADIENT_ACCUMULATION_STEPS": "3",
        "CUDA_VISIBLE_DEVICES": "",
    }
    assert any("TRAINER_EXT_GRADIENT_ACCUMULATION_STEPS itself" in n for n in plan.notes)


def test_gpu_ids_choose_the_visible_gpus_and_the_process_count(gpus, script):
    gpus(4)
    settings, plan = plan_of("--gpu_ids", "1,3", script)
    assert settings["num_processes"] == 2 and settings["device"] == "cuda"
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "1,3"
    settings, _ = plan_of(script)
    assert settings["nproc_per_node"] == 4 and "one process per GPU" in settings.sources["nproc_per_node"]


def test_fp8_on_a_gpu_is_passed_on_and_noted(gpus):
    gpus(1)
    settings, plan = plan_of("--mixed_precision", "fp8", "train")
    assert plan.command[-1] == "--fp8" and plan.env == {}
    assert any("fp8 needs a GPU of compute capability >= 8.9" in note for note in settings.notes)
    _, plan = plan_of("--mixed_precision", "fp8", "train", "--bf16")
    assert "--fp8" not in plan.command and any("already set --bf16" in note for note in plan.notes)


def test_deepspeed_and_fsdp_become_train_flags(gpus, tmp_path):
    ds, fsdp = tmp_path / "ds.json", tmp_path / "fsdp.yaml"
    ds.write_text("{}")
    fsdp.write_text("{}")
    _, plan = plan_of("--deepspeed", str(ds), "train")
    assert plan.command[-2:] == ["--deepspeed", str(ds)]
    _, plan = plan_of("--num_processes", "2", "--fsdp_config", str(fsdp), "train", "--max_steps", "1")
    assert plan.command[-4:] == ["--fsdp", "full_shard", "--fsdp_config", str(fsdp)]


def test_dry_run_prints_each_value_with_where_it_came_from(gpus, home, capsys):
    config = home / ".cache" / "trainer_ext" / "default_config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 4\nmixed_precision: bf16\nsame_network: true\n")
    assert main(["launch", "--num_processes", "2", "--dry_run", "train", "--max_steps", "3"]) == 0
    captured = capsys.readouterr()
    rows = {line.split()[0]: line for line in captured.out.splitlines() if line.startswith("  ") and "  " in line[2:]}
    assert f"config file: {config} (default location)" in captured.out
    assert rows["num_processes"].split()[1] == "2" and rows["num_processes"].endswith("command line --num_processes")
    assert rows["mixed_precision"].split()[1] == "bf16" and rows["mixed_precision"].endswith(f"config file {config}")
    assert rows["device"].endswith("accelerate key distributed_type=MULTI_CPU")
    assert rows["gradient_accumulation_steps"].endswith("default")
    assert rows["main_process_ip"].split()[1] == "127.0.0.1"
    assert "num_processes 4 from config file" in captured.out and "is overridden" in captured.out
    command = captured.out.split("command:\n")[1].strip()
    assert command.startswith(f"{sys.executable} -m torch.distributed.run --nnodes 1 --nproc_per_node 2")
    assert command.endswith("-m trainer_ext train --max_steps 3 --use_cpu --bf16")
    assert "ignored accelerate keys (no effect here): same_network" in captured.err


def test_config_file_lookup_order(gpus, home, tmp_path, monkeypatch, script):
    default = home / ".cache" / "trainer_ext" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text("num_processes: 3\n")
    from_env, explicit = tmp_path / "env.yaml", tmp_path / "explicit.yaml"
    from_env.write_text("num_processes: 4\n")
    explicit.write_text("num_processes: 5\n")
    assert plan_of(script)[0]["num_processes"] == 3
    monkeypatch.setenv("TRAINER_EXT_CONFIG_FILE", str(from_env))
    assert plan_of(script)[0]["num_processes"] == 4
    assert plan_of("--config_file", str(explicit), script)[0]["num_processes"] == 5
    assert plan_of("--config_file", str(explicit), "--num_processes", "1", script)[0]["num_processes"] == 1


@pytest.mark.parametrize(
    ("config", "argv", "message"),
    [
        (
            "distributed_type: MULTI_GPU\ngpu_ids: 0,1,2,3\nnum_processes: 4\n",
            [],
            "gpu_ids 0,1,2,3 from config file",
        ),
        ("num_proceses: 2\n", [], "unknown key 'num_proceses'. Did you mean 'num_processes'"),
        ("distributed_type: MULTI_GPUS\n", [], "Did you mean 'MULTI_GPU'"),
        ("mixed_precision: bf61\n", [], "is not one of no, bf16, fp16, fp8. Did you mean 'bf16'"),
        ("", ["--num_machines", "2", "--machine_rank", "2", "--main_process_ip", "h"], "must be below num_machines 2"),
        ("", ["--num_machines", "2"], "2 machines need --main_process_ip"),
        ("", ["--mixed_precision", "fp16"], "fp16 (command line --mixed_precision) needs a CUDA GPU"),
        ("", ["--num_processes", "3", "--num_machines", "2", "--main_process_ip", "h"], "must divide evenly"),
        ("", ["--num_processes", "4", "--nproc_per_node", "1"], "give only one of them"),
        (
            "",
            ["--deepspeed", "missing.json"],
            "deepspeed file 'missing.json' (command line --deepspeed) does not exist",
        ),
        ("compute_environment: AMAZON_SAGEMAKER\n", [], "compute_environment AMAZON_SAGEMAKER is not supported"),
        ("", ["--num_processes", "0"], "--num_processes: 0 must be between 1 and 1048576"),
        ("", ["--gpu_ids", "first"], "--gpu_ids: 'first' is not 'all' or a list of GPU indices"),
        ("", ["--main_process_port", "99999"], "--main_process_port: 99999 must be between 1 and 65535"),
    ],
)
def test_bad_input_is_reported_before_anything_starts(gpus, tmp_path, capsys, script, config, argv, message):
    path = tmp_path / "launch.yaml"
    path.write_text(config)
    err = error_of(capsys, "--config_file", str(path), *argv, script)
    assert message in err, err


def test_every_problem_is_listed_at_once(gpus, capsys):
    err = error_of(capsys, "--num_machines", "2", "--machine_rank", "5", "--mixed_precision", "fp16", "nothere.py")
    assert "cannot launch (4 problems)" in err
    assert "script 'nothere.py' not found" in err


def test_gpu_ids_beyond_the_visible_gpus_and_too_many_processes(gpus, capsys, script):
    gpus(2)
    assert "names GPU(s) 2, 3 but only 2 are visible" in error_of(capsys, "--gpu_ids", "0,1,2,3", script)
    assert "each process needs its own GPU" in error_of(capsys, "--num_processes", "3", script)


def test_unknown_option_module_and_missing_target(gpus, capsys):
    assert "unknown option --num_proceses. Did you mean '--num_processes'" in error_of(capsys, "--num_proceses", "2")
    assert "module 'no_such_module_xyz' not found" in error_of(capsys, "-m", "no_such_module_xyz")
    assert "nothing to launch" in error_of(capsys, "--cpu")
    assert "--gpu_ids needs a value" in error_of(capsys, "--gpu_ids")


def test_deepspeed_and_fsdp_reach_a_script_through_their_variables(gpus, tmp_path, capsys, script):
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2}}')
    settings, plan = plan_of("--deepspeed", str(ds), script)
    assert plan.env["TRAINER_EXT_DEEPSPEED_CONFIG"] == str(ds) and "TRAINER_EXT_FSDP_CONFIG" not in plan.env
    assert any("TRAINER_EXT_DEEPSPEED_CONFIG is set" in note for note in plan.notes)
    # a file DeepSpeed cannot use stops the launch (exit 2) before any process starts
    ds.write_text('{"zero_optimization": {"stage": 7}}')
    assert "stage" in error_of(capsys, "--deepspeed", str(ds), script)
    # FSDP: the settings as parsed (unset ones left out), and one process goes through torchrun for its group
    fsdp = Path(__file__).resolve().parents[2] / "configs" / "fsdp" / "shard_grad_op.yaml"
    settings, plan = plan_of("--fsdp_config", str(fsdp), script)
    exported = json.loads(plan.env["TRAINER_EXT_FSDP_CONFIG"])
    assert exported["reshard_after_forward"] is False and exported["auto_wrap_policy"] == "transformer"
    assert "param_dtype" not in exported and "TRAINER_EXT_DEEPSPEED_CONFIG" not in plan.env
    assert any("TRAINER_EXT_FSDP_CONFIG is set" in note for note in plan.notes)
    assert plan.torchrun_args is not None and plan.fsdp is not None
    bad = tmp_path / "bad.yaml"
    bad.write_text("sharding_strategy: NO_SHARD\nreshard_after_forwad: true\n")
    err = error_of(capsys, "--fsdp_config", str(bad), script)
    assert "NO_SHARD" in err and "reshard_after_forwad" in err
    assert "choose one" in error_of(capsys, "--fsdp_config", str(fsdp), "--deepspeed", str(ds), script)


def test_a_port_in_use_is_refused(gpus, capsys, script):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = error_of(capsys, "--num_processes", "2", "--main_process_port", str(port), script)
        assert f"port {port} is already in use" in err
        multi = ["--num_machines", "2", "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
        assert "already in use" in error_of(capsys, *multi, script)
        # machine 1 does not open the port: it connects to machine 0
        prepare([*multi, "--machine_rank", "1", script])


def test_bad_input_from_the_shell_has_no_traceback(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"distributed_type": "MULTI_GPU", "gpu_ids": "0,1,2,3", "use_cpu": "maybe"}))
    proc = subprocess.run(
        [sys.executable, "-m", "trainer_ext", "launch", "--config_file", str(config), "train"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "use_cpu: 'maybe' is not true or false" in proc.stderr


def test_help_exits_zero(capsys):
    assert main(["launch", "--help"]) == 0
    assert "--num_processes" in capsys.readouterr().out


def test_config_error_class_is_reused():
    with pytest.raises(ConfigError):
        prepare(["--num_processes", "x", "train"])


def test_training_arguments_in_a_script_read_the_precision_variable(monkeypatch, tmp_path):
    """The contract the launcher relies on for scripts: ACCELERATE_MIXED_PRECISION becomes args.mixed_precision."""
    from trainer_ext import TrainingArguments

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert TrainingArguments(str(tmp_path), use_cpu=True, report_to="none").mixed_precision == "bf16"


def test_one_process_with_restarts_goes_through_torchrun_on_loopback(gpus, script, capsys):
    settings, plan = plan_of("--cpu", "--max_restarts", "2", "--rdzv_timeout", "30", script)
    args = plan.torchrun_args
    assert args is not None and plan.command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert args[args.index("--nproc_per_node") + 1] == "1" and args[args.index("--max_restarts") + 1] == "2"
    assert args[args.index("--rdzv_endpoint") + 1] == "127.0.0.1:0"
    assert args[args.index("--local_addr") + 1] == "127.0.0.1"
    assert args[args.index("--rdzv_conf") + 1] == "join_timeout=30"
    assert settings["main_process_ip"] == "127.0.0.1" and plan.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert main(["launch", "--cpu", "--max_restarts", "2", "--dry_run", script]) == 0
    command = capsys.readouterr().out.split("command:\n")[1]
    assert "-m torch.distributed.run --nnodes 1 --nproc_per_node 1" in command and "--max_restarts 2" in command


def test_rdzv_timeout_without_restarts_on_one_process_is_noted_as_ignored(gpus, script):
    settings, plan = plan_of("--cpu", "--rdzv_timeout", "30", script)
    assert plan.torchrun_args is None
    assert any(note.startswith("rdzv_timeout (command line --rdzv_timeout) is ignored") for note in settings.notes)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["--mixed_precision", "bf61"],
            "error: launch: --mixed_precision: 'bf61' is not one of no, bf16, fp16, fp8. Did you mean 'bf16'?",
        ),
        (
            ["--rdzv_backend", "c10"],
            "error: launch: --rdzv_backend: 'c10' is not one of static, c10d, etcd, etcd-v2. Did you mean 'c10d'?",
        ),
    ],
)
def test_a_bad_choice_is_one_line_with_the_closest_valid_value(gpus, capsys, script, argv, line):
    assert error_of(capsys, *argv, script) == line + "\n"


def _this_machines_address() -> str:
    """A non-loopback address of this machine (no packet is sent); skip the test where there is none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            address = probe.getsockname()[0]
        except OSError:
            address = "127.0.0.1"
    if address.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address")
    return address


def test_c10d_checks_the_port_on_the_machine_that_hosts_the_store(gpus, capsys, script):
    """Under c10d the machine whose address is main_process_ip hosts the store: a busy port there is refused."""
    here = _this_machines_address()
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        c10d = ["--num_machines", "2", "--rdzv_backend", "c10d", "--main_process_port", port]
        err = error_of(capsys, *c10d, "--main_process_ip", here, "--dry_run", script)  # broken: it would launch
        assert f"port {port} is already in use on this machine" in err and "c10d rendezvous store is hosted" in err
        # on loopback every "machine" runs here, so the busy port may be another launcher of the job: a note
        settings, _ = plan_of(*c10d, "--main_process_ip", "127.0.0.1", script)
        assert any(f"port {port} on 127.0.0.1 is already in use" in note for note in settings.notes)
        plan_of(*c10d, "--main_process_ip", "203.0.113.7", script)  # another machine hosts it: nothing to check


@pytest.mark.parametrize("word", ["trian", "tain", "Train", "trainn"])
def test_a_misspelt_train_is_named(gpus, capsys, tmp_path, monkeypatch, word):
    monkeypatch.chdir(tmp_path)
    err = error_of(capsys, "--num_processes", "2", "--cpu", word, "--max_steps", "5")
    assert (
        f"{word!r} is neither a script (no such file in {tmp_path}) nor a command (train). Did you mean 'train'?"
        in err
    )


def test_a_script_named_like_train_still_runs(gpus, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trian").write_text("print('mine')\n")
    _, plan, dry_run = prepare(["--cpu", "--dry_run", "trian"])
    assert dry_run and plan.command[-1] == "trian" and "train" not in plan.command
    assert "script 'trainer.py' not found" in error_of(capsys, "--cpu", "trainer.py")  # a path: no command hint
    assert "Did you mean" not in error_of(capsys, "--cpu", "trainer.py")
