"""``trainer-ext plan``'s own flags: bad input is one line and exit 2, the text shows the top layouts and commands."""

from __future__ import annotations

import pytest

from trainer_ext.cli.main import main

JOB = ["--model_config", "tiny-llama", "--task", "causal-lm"]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ([], ["--gpus_per_machine", "--num_processes"]),
        (["--num_processes", "3", "--num_machines", "2", "--cpu"], ["does not split evenly", "--num_machines 2"]),
        (["--num_processes", "4", "--gpus_per_machine", "4", "--num_machines", "2", "--cpu"], ["is not"]),
        (["--num_processes", "2", "--cpu", "--interconnect", "carrier-pigeon"], ["--interconnect", "nvlink,ib"]),
        (["--num_processes", "0", "--cpu"], ["between 1 and"]),
        (["--num_machines", "2", "--gpus_per_machine", "2", "--cpu", "--verify"], ["--verify", "one machine"]),
        (["--num_processes", "2", "--cpu", "--no_such_flag", "1"], ["--no_such_flag"]),
        (["--num_processes", "2", "--device_memory", "lots"], ["--device_memory"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, flags: list[str], words: list[str]) -> None:
    assert main(["plan", *JOB, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:"), err
    for word in words:
        assert word in err, (word, err)


def test_without_a_gpu_the_device_memory_is_asked_for(capsys, monkeypatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["plan", *JOB, "--num_processes", "2"]) == 2
    err = capsys.readouterr().err
    assert "--device_memory" in err and "--cpu" in err


def test_the_text_lists_the_top_layouts_with_their_reasons_and_commands(capsys) -> None:
    assert main(["plan", *JOB, "--num_processes", "4", "--cpu", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "cluster: 4 CPU processes (shm)" in out
    assert out.count("\n1. ") == 1 and out.count("\n2. ") == 1 and "\n3. " not in out
    commands = [line.strip() for line in out.splitlines() if line.strip().startswith("$ ")]
    assert len(commands) == 2
    assert all(c.startswith("$ trainer-ext launch --num_processes ") and " --cpu train " in c for c in commands)
    assert "memory per rank: peak" in out and "step " in out
