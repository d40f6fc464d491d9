"""The GPU kit's carriage: benchmarks/gpu_wheels.txt pins one version of each wheel, the scripts parse, .whl/ stays out."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")


def _pins() -> list[tuple[str, str]]:
    """gpu_wheels.txt as (normalized name, version), comments and blank lines dropped; fails on a malformed line."""
    pins = []
    for number, raw in enumerate((BENCH / "gpu_wheels.txt").read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = PIN.match(line)
        assert match, f"gpu_wheels.txt:{number}: {raw!r} is not name==version"
        pins.append((re.sub(r"[-_.]+", "-", match[1]).lower(), match[2]))
    return pins


def test_one_version_of_each_and_the_kit_needs_are_there() -> None:
    names = [name for name, _ in _pins()]
    assert len(names) == len(set(names)), f"named twice: {sorted({n for n in names if names.count(n) > 1})}"
    assert {"datasets", "evaluate", "deepspeed", "torchao"} <= set(names)
    assert "accelerate" not in names  # the image has it; trainer_ext must never need it


@pytest.mark.parametrize("script", ["gpu_wheels.sh", "gpu_run.sh"])
def test_scripts_parse(script: str) -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash here")
    proc = subprocess.run([bash, "-n", str(BENCH / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_gpu_run_documents_a_valid_device_call() -> None:
    """The `run` call in gpu_run.sh's header carries .whl and fits the tool's limits (2000 characters, 600 s)."""
    text = (BENCH / "gpu_run.sh").read_text()
    call = re.search(r'run\(command="([^"]+)", carry=\[("[^]]*")\], timeout_s=(\d+)\)', text)
    assert call, "gpu_run.sh's header names no run(command=..., carry=[...], timeout_s=...) call"
    assert len(call[1]) <= 2000 and '".whl"' in call[2] and int(call[3]) <= 600


def test_wheels_are_never_committed() -> None:
    assert "/.whl/" in (BENCH / "gpu_wheels.sh").read_text()  # the script adds it to .git/info/exclude
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "--", ".whl"], cwd=ROOT, capture_output=True, text=True).stdout
    assert tracked == ""
