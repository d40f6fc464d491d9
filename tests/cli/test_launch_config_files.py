"""Launch config files: accelerate's YAML keys are mapped, ignored keys are named, bad keys and values explained."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from trainer_ext.cli.launch import prepare
from trainer_ext.cli.launch.config_file import IGNORED_KEYS, find_config_file, read_config_file

# What `accelerate config` writes for two CPU machines (accelerate 1.x), field for field.
ACCELERATE_MULTI_CPU = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 1
main_process_ip: 10.1.0.7
main_process_port: 29555
main_training_function: main
mixed_precision: bf16
num_machines: 2
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_accelerate_multi_cpu_file_is_mapped_key_by_key(tmp_path):
    path = write(tmp_path / "accelerate.yaml", ACCELERATE_MULTI_CPU)
    config = read_config_file(path)
    assert config.problems == []
    assert config.values == {
        "debug": False,
        "distributed_type": "MULTI_CPU",
        "machine_rank": 1,
        "main_process_ip": "10.1.0.7",
        "main_process_port": 29555,
        "mixed_precision": "bf16",
        "num_machines": 2,
        "num_processes": 8,
        "rdzv_backend": "static",
        "cpu": True,
    }
    assert config.sources["cpu"] == f"config file {path}, accelerate key use_cpu"
    assert sorted(config.ignored) == [
        "downcast_bf16",
        "enable_cpu_affinity",
        "main_training_function",
        "same_network",
        "tpu_env",
        "tpu_use_cluster",
        "tpu_use_sudo",
    ]
    assert set(config.ignored) <= set(IGNORED_KEYS)


def test_accelerate_file_gives_the_same_launch_as_the_flags(gpus, tmp_path):
    path = write(tmp_path / "accelerate.yaml", ACCELERATE_MULTI_CPU)
    from_file = prepare(["--config_file", str(path), "train"])[1]
    flags = prepare(
        ["--cpu", "--mixed_precision", "bf16", "--num_processes", "8", "--num_machines", "2", "--machine_rank", "1"]
        + ["--main_process_ip", "10.1.0.7", "--main_process_port", "29555", "train"]
    )[1]
    assert from_file.command == flags.command
    assert "--nproc_per_node 4" in " ".join(from_file.command)  # accelerate's num_processes is the total


def test_distributed_type_no_means_one_process_and_multi_cpu_means_cpu(tmp_path):
    config = read_config_file(write(tmp_path / "a.yaml", "distributed_type: 'NO'\nmixed_precision: no\n"))
    assert config.values["num_processes"] == 1 and config.values["mixed_precision"] == "no"  # bare `no` is False
    config = read_config_file(write(tmp_path / "b.yaml", "distributed_type: MULTI_CPU\n"))
    assert config.values["cpu"] is True and "distributed_type=MULTI_CPU" in config.sources["cpu"]


def test_deepspeed_section_gives_the_json_path_and_names_what_it_ignores(tmp_path):
    text = yaml.safe_dump(
        {
            "distributed_type": "DEEPSPEED",
            "deepspeed_config": {
                "deepspeed_config_file": "ds.json",
                "zero3_init_flag": False,
                "gradient_accumulation_steps": 4,
            },
        }
    )
    config = read_config_file(write(tmp_path / "ds.yaml", text))
    assert config.values["deepspeed"] == "ds.json" and config.values["gradient_accumulation_steps"] == 4
    assert config.ignored == ["deepspeed_config.zero3_init_flag"]


def test_accelerates_inline_deepspeed_keys_become_a_deepspeed_config(tmp_path):
    """What `accelerate config` writes for DeepSpeed: ZeRO keys inline, no JSON file."""
    section = {
        "zero_stage": 3,
        "offload_optimizer_device": "cpu",
        "offload_param_device": "none",
        "gradient_clipping": 0.5,
        "zero3_save_16bit_model": True,
        "zero3_init_flag": True,
        "gradient_accumulation_steps": 2,
    }
    text = yaml.safe_dump({"distributed_type": "DEEPSPEED", "deepspeed_config": section})
    config = read_config_file(write(tmp_path / "inline.yaml", text))
    assert config.problems == []
    built = config.values["deepspeed"]
    assert built["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    assert built["gradient_clipping"] == 0.5 and built["train_micro_batch_size_per_gpu"] == "auto"
    assert built["bf16"] == {"enabled": "auto"} and config.values["gradient_accumulation_steps"] == 2
    assert config.ignored == ["deepspeed_config.zero3_init_flag"]
    bad = {"zero_stag": 2, "zero_stage": "three"}
    config = read_config_file(write(tmp_path / "bad.yaml", yaml.safe_dump({"deepspeed_config": bad})))
    assert any("deepspeed_config.zero_stag" in p and "Did you mean 'zero_stage'" in p for p in config.problems)
    assert any("zero_stage 'three' is not one of 0, 1, 2, 3" in p for p in config.problems)


def test_fsdp_section_becomes_sharding_and_a_json_config_for_train(gpus, tmp_path):
    text = yaml.safe_dump(
        {
            "distributed_type": "FSDP",
            "num_processes": 2,
            "use_cpu": True,
            "fsdp_config": {"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_offload_params": True},
        }
    )
    path = write(tmp_path / "fsdp.yaml", text)
    command = prepare(["--config_file", str(path), "train"])[1].command
    i = command.index("--fsdp")
    assert command[i + 1] == "shard_grad_op offload" and command[i + 2] == "--fsdp_config"
    assert json.loads(command[i + 3]) == {"fsdp_offload_params": True, "fsdp_sharding_strategy": "SHARD_GRAD_OP"}


def test_every_bad_key_and_value_is_collected(tmp_path):
    text = "num_proceses: 2\nnum_machines: two\nmain_process_port: 70000\ngpu_ids: 0,0\nrdzv_backend: etdc\n"
    config = read_config_file(write(tmp_path / "bad.yaml", text))
    problems = "\n".join(config.problems)
    assert len(config.problems) == 5
    assert "unknown key 'num_proceses'. Did you mean 'num_processes'" in problems
    assert "num_machines: 'two' is not a whole number" in problems
    assert "main_process_port: 70000 must be between 1 and 65535" in problems
    assert "gpu_ids: '0,0' names a GPU twice" in problems
    assert "Did you mean 'etcd'" in problems


def test_unreadable_and_odd_files(tmp_path):
    assert "no such file" in read_config_file(tmp_path / "missing.yaml").problems[0]
    assert "is not valid YAML" in read_config_file(write(tmp_path / "x.yaml", "a: [")).problems[0]
    assert "must hold a mapping" in read_config_file(write(tmp_path / "y.yaml", "- 1\n")).problems[0]
    assert read_config_file(write(tmp_path / "empty.yaml", "")).values == {}
    assert read_config_file(write(tmp_path / "c.json", '{"num_processes": 2}')).values == {"num_processes": 2}


def test_default_location_is_used_only_when_present(home, monkeypatch, tmp_path):
    assert find_config_file(None)[0] is None
    default = home / ".cache" / "trainer_ext" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text("")
    assert find_config_file(None) == (default, "default location")
    monkeypatch.setenv("TRAINER_EXT_CONFIG_FILE", str(tmp_path / "other.yaml"))
    assert find_config_file(None) == (tmp_path / "other.yaml", "$TRAINER_EXT_CONFIG_FILE")
    assert find_config_file("given.yaml") == (Path("given.yaml"), "--config_file")
