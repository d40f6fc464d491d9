"""``trainer-ext config``: the questionnaire (answers from stdin), ``--default`` and ``validate FILE``."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import yaml

from trainer_ext.cli.launch.config_file import read_config_file
from trainer_ext.cli.main import main

DEFAULT = Path(".cache") / "trainer_ext" / "default_config.yaml"


def answer(monkeypatch: pytest.MonkeyPatch, *lines: str) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{line}\n" for line in lines)))


def written(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_questionnaire_for_two_cpu_machines_writes_the_default_location(gpus, home, monkeypatch, capsys):
    # environment, machine type, machines, this rank, main address, port (Enter), backend, processes,
    # DeepSpeed, FSDP, mixed precision
    answer(monkeypatch, "", "multi_cpu", "2", "1", "10.0.0.1", "", "c10d", "4", "no", "no", "bf16")
    assert main(["config"]) == 0
    assert written(home / DEFAULT) == {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "MULTI_CPU",
        "num_machines": 2,
        "machine_rank": 1,
        "main_process_ip": "10.0.0.1",
        "main_process_port": 29500,
        "rdzv_backend": "c10d",
        "num_processes": 4,
        "use_cpu": True,
        "mixed_precision": "bf16",
    }
    assert read_config_file(home / DEFAULT).problems == []
    assert f"wrote {home / DEFAULT}" in capsys.readouterr().out


def test_questionnaire_asks_again_after_a_bad_answer(gpus, tmp_path, monkeypatch, capsys):
    answer(monkeypatch, "", "MULTI_CPUU", "MULTI_CPU", "1", "three", "3", "no", "/data/fsdp.yaml", "fp16")
    target = tmp_path / "out.yaml"
    assert main(["config", "--config_file", str(target)]) == 0
    captured = capsys.readouterr()
    assert "Did you mean 'MULTI_CPU'" in captured.out and "'three' is not a whole number" in captured.out
    config = written(target)
    assert config["num_processes"] == 3 and config["distributed_type"] == "FSDP"
    assert config["fsdp_config"] == "/data/fsdp.yaml"
    # written as asked, but this machine could not launch it: the user is told why
    assert "fp16" in captured.err and "does not exist" in captured.err


def test_questionnaire_on_a_gpu_machine_offers_one_process_per_gpu(gpus, tmp_path, monkeypatch):
    gpus(4)
    answer(monkeypatch, "", "", "", "0,1", "", "", "", "")
    target = tmp_path / "gpu.yaml"
    assert main(["config", "--config_file", str(target)]) == 0
    config = written(target)
    assert (config["distributed_type"], config["gpu_ids"], config["num_processes"]) == ("MULTI_GPU", "0,1", 2)


def test_questionnaire_stops_cleanly_when_input_ends(gpus, tmp_path, monkeypatch, capsys):
    answer(monkeypatch, "", "MULTI_CPU")
    assert main(["config", "--config_file", str(tmp_path / "x.yaml")]) == 2
    assert "input ended" in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()


def test_default_writes_without_questions_and_does_not_overwrite(gpus, home, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["config", "--default"]) == 0
    assert written(home / DEFAULT)["distributed_type"] == "NO"
    assert main(["config", "--default"]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    gpus(8)
    assert main(["config", "--default", "--overwrite"]) == 0
    config = written(home / DEFAULT)
    assert (config["distributed_type"], config["num_processes"], config["gpu_ids"]) == ("MULTI_GPU", 8, "all")


def test_default_honours_the_environment_variable(gpus, tmp_path, monkeypatch):
    target = tmp_path / "team" / "launch.yaml"
    monkeypatch.setenv("TRAINER_EXT_CONFIG_FILE", str(target))
    assert main(["config", "--default"]) == 0
    assert target.is_file()


def test_validate_explains_every_problem(gpus, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "distributed_type: MULTI_GPU\ngpu_ids: 0,1,2,3\nnum_machines: 2\nmachine_rank: 2\nnum_proceses: 4\n"
        "same_network: true\n"
    )
    assert main(["config", "validate", str(bad)]) == 2
    out = capsys.readouterr().out
    assert f"{bad}: 4 problem(s)" in out
    for text in ("unknown key 'num_proceses'", "machine_rank 2", "need --main_process_ip", "no CUDA GPU"):
        assert text in out
    assert "same_network: the rendezvous always uses main_process_ip:main_process_port" in out


def test_validate_ok_shows_what_the_file_resolves_to(gpus, tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\n")
    assert main(["config", "validate", str(good)]) == 0
    out = capsys.readouterr().out
    assert f"{good}: OK" in out and "nproc_per_node               2" in out
    assert main(["config", "validate"]) == 2


def one_error_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err
    return captured.err


def test_a_path_that_cannot_be_written_is_one_error_line(gpus, capsys):
    err = one_error_line(capsys, ["config", "--default", "--config_file", "/proc/nope/x.yaml"])
    assert "cannot write /proc/nope/x.yaml" in err and "choose another --config_file" in err


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_directory_is_refused_and_left_alone(gpus, tmp_path, capsys, overwrite):
    kept = tmp_path / "keep.txt"
    kept.write_text("mine")
    err = one_error_line(capsys, ["config", "--default", "--config_file", str(tmp_path), *overwrite])
    assert f"{tmp_path} is a directory; --config_file takes the path of a file" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "keep.txt"] and kept.read_text() == "mine"


def test_the_questionnaire_refuses_a_directory_before_asking(gpus, tmp_path, monkeypatch, capsys):
    answer(monkeypatch)
    err = one_error_line(capsys, ["config", "--config_file", str(tmp_path)])
    assert "is a directory" in err and capsys.readouterr().out == ""


FSDP_NO_SHARD = {
    "distributed_type": "FSDP",
    "num_processes": 2,
    "use_cpu": True,
    "fsdp_config": {"fsdp_sharding_strategy": "NO_SHARD", "fsdp_auto_wrap_polcy": "TRANSFORMER_BASED_WRAP"},
}


def test_validate_checks_the_fsdp_settings(gpus, tmp_path, capsys):
    bad = tmp_path / "fsdp.yaml"
    bad.write_text(yaml.safe_dump(FSDP_NO_SHARD))
    assert main(["config", "validate", str(bad)]) == 2
    out = capsys.readouterr().out
    assert f"{bad}: 1 problem(s)" in out
    assert "sharding_strategy NO_SHARD replicates the whole model" in out
    assert "unknown key 'fsdp_auto_wrap_polcy'. Did you mean 'auto_wrap_policy'" in out
    one = tmp_path / "one.yaml"  # one FSDP process is launched through torchrun: a process group of one
    one.write_text(yaml.safe_dump({**FSDP_NO_SHARD, "num_processes": 1, "fsdp_config": {"fsdp_version": 2}}))
    assert main(["config", "validate", str(one)]) == 0, capsys.readouterr().out


@pytest.mark.timeout(60)  # a FIFO target once blocked the write until a reader came
def test_a_target_that_is_not_a_regular_file_is_refused_before_writing(gpus, tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "full.yaml").symlink_to("/dev/full")
    cases = [
        (tmp_path / "fifo.yaml", "fifo.yaml is not a regular file (a FIFO or a device)"),
        (tmp_path / "full.yaml", "full.yaml is not a regular file (a FIFO or a device)"),
        (tmp_path / ("c" * 300 + ".yaml"), "File name too long; choose another --config_file"),
    ]
    for path, words in cases:
        assert main(["config", "--default", "--overwrite", "--config_file", str(path)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and words in err, err
