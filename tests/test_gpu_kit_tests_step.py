"""The GPU kit's ``tests`` step: its CUDA pass collects, the device switch maps as docs/testing.md says, and the
JUnit parsing counts what pytest ran."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_kit import tests_step
from tests.helpers.device import VARIABLE, chosen_device, switch_problem, use_cpu
from tests.helpers.jobs import make_args
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.timeout(300)


def _pytest(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        tests_step.pytest_command(*args),
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_entry_of_the_cuda_pass_exists_and_collects() -> None:
    proc = _pytest("--collect-only", *tests_step.CUDA_PASS, **{VARIABLE: "cpu"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = tests_step.collected_ids(proc.stdout)
    assert len(ids) >= len(tests_step.CUDA_PASS)
    assert tests_step.unmatched(tests_step.CUDA_PASS, ids) == []
    assert not any("distributed" in i for i in ids)  # one process only: no gloo ranks in the CUDA pass


def test_an_entry_that_collects_nothing_is_reported() -> None:
    ids = ["tests/test_a.py::test_x[1]", "tests/test_a.py::test_y", "tests/b/test_c.py::TestK::test_z"]
    entries = ["tests/test_a.py::test_x", "tests/test_a.py", "tests/b/test_c.py::TestK", "tests/test_a.py::test_"]
    assert tests_step.unmatched(entries + ["tests/test_nope.py", "tests/test_a.py::test_w"], ids) == [
        "tests/test_a.py::test_",
        "tests/test_nope.py",
        "tests/test_a.py::test_w",
    ]


@pytest.mark.parametrize(
    "environ,device",
    [({}, "cpu"), ({VARIABLE: ""}, "cpu"), ({VARIABLE: "cpu"}, "cpu"), ({VARIABLE: "cuda"}, "cuda")],
)
def test_the_switch_maps_to_use_cpu(environ: dict, device: str) -> None:
    assert chosen_device(environ) == device
    assert use_cpu(environ) is (device == "cpu")


@pytest.mark.parametrize("value", ["tpu", "CUDA", "cuda:0", "mps"])
def test_an_unknown_value_is_an_error(value: str) -> None:
    with pytest.raises(ValueError, match=f"{VARIABLE}='{value}' is not a test device: set it to 'cpu'"):
        use_cpu({VARIABLE: value})
    assert switch_problem({VARIABLE: value}) is not None


def test_make_args_follows_the_switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert make_args(tmp_path).use_cpu is True
    monkeypatch.setenv(VARIABLE, "cuda")
    assert make_args(tmp_path).use_cpu is False
    assert make_args(tmp_path, use_cpu=True).use_cpu is True
    monkeypatch.setenv(VARIABLE, "gpu")
    with pytest.raises(ValueError, match="is not a test device"):
        make_args(tmp_path)


def test_a_bad_switch_stops_the_session_before_any_test() -> None:
    proc = _pytest("tests/test_gpu_kit_tests_step.py::test_the_switch_maps_to_use_cpu", **{VARIABLE: "gpu"})
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert f"{VARIABLE}='gpu' is not a test device" in proc.stdout + proc.stderr
    assert "passed" not in proc.stdout
    if not torch.cuda.is_available():  # cuda asked for where there is none: never a silent CPU run
        proc = _pytest("tests/test_gpu_kit_tests_step.py::test_the_switch_maps_to_use_cpu", **{VARIABLE: "cuda"})
        assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
        assert "torch sees no CUDA GPU here" in proc.stdout + proc.stderr


SAMPLE = """
import pytest

def test_passes():
    print("figure: 1.5")

def test_fails():
    assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="not here")
def test_skips():
    pass

class TestGroup:
    @pytest.mark.parametrize("x", [1, 2])
    def test_param(self, x):
        assert x == 1

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_errors(broken):
    pass
"""


def test_the_junit_file_gives_counts_node_ids_and_reasons(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    junit = tmp_path / "out.xml"
    args = [f"--junitxml={junit}", "-o", "junit_family=xunit1", "-o", "junit_logging=system-out", "test_sample.py"]
    proc = subprocess.run(tests_step.pytest_command(*args), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    result = tests_step.parse_junit(junit)
    assert {k: result[k] for k in ("tests", "passed", "failed", "errors", "skipped")} == {
        "tests": 6,
        "passed": 2,
        "failed": 2,
        "errors": 1,
        "skipped": 1,
    }
    reasons = dict(f.split(": ", 1) for f in result["failures"])
    assert reasons["test_sample.py::test_fails (failure)"].startswith("AssertionError: one is not two")
    assert "test_sample.py::TestGroup::test_param[2] (failure)" in reasons
    assert "fixture broke" in reasons["test_sample.py::test_errors (error)"]
    assert "test_sample.py::test_passes: figure: 1.5" in result["printed"]


def test_the_summary_names_the_counts_and_the_failures() -> None:
    figures = {"gpu_tests": 3, "gpu_passed": 2, "gpu_failed": 1, "gpu_errors": 0, "gpu_skipped": 0}
    figures |= {"gpu_seconds": 30.0, "gpu_failures": ["tests/test_gpu.py::test_x (failure): boom"]}
    figures |= {"pass_entries": 15, "pass_collected": 19}
    lines = tests_step.summarize(figures)
    assert lines[0] == "`pytest -m gpu tests`: 2 passed, 1 failed, 0 errors, 0 skipped in 30.0 s"
    assert lines[1] == "CUDA pass (dry run): 19 tests collected from 15 entries"
    assert lines[2] == "failed: tests/test_gpu.py::test_x"
