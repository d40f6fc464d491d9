"""``trainer-ext estimate`` against careless and hostile input: absurd process counts, --json targets that fail.

Each is one ``error:`` line and exit code 2, never a traceback, and a failed write leaves the old file whole.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_ext.cli.main import main

TINY = ["--model_config", "tiny-llama", "--task", "causal-lm"]


def _refused(capsys: pytest.CaptureFixture, *argv: str) -> str:
    code = main(["estimate", *argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (str(10**29), f"--num_processes: {10**29} must be between 1 and 1048576"),
        ("1048577", "--num_processes: 1048577 must be between 1 and 1048576"),
        ("0", "--num_processes: 0 must be between 1 and 1048576"),
        ("1e29", "--num_processes: needs a whole number between 1 and 1048576, got '1e29'"),
    ],
)
def test_absurd_process_counts_are_refused_with_the_valid_range(capsys, value: str, words: str) -> None:
    assert _refused(capsys, "--num_processes", value, *TINY) == f"error: estimate: {words}"


@pytest.mark.timeout(120)  # a FIFO nobody reads must be refused, not waited on
def test_json_targets_that_fail_are_one_line(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "json"  # beside the test's own home folder
    folder.mkdir()
    os.mkfifo(folder / "out.fifo")
    cases = [
        ("/dev/full", "error: --json /dev/full cannot be written: No space left on device"),
        (str(folder / "out.fifo"), "out.fifo is a FIFO that nothing reads; start its reader first or give a file"),
        (str(folder / ("j" * 300 + ".json")), "the path is too long for the file system (File name too long)"),
    ]
    for path, words in cases:
        assert words in _refused(capsys, *TINY, "--json", path), path
    assert sorted(os.listdir(folder)) == ["out.fifo"]  # no temporary left behind


def test_json_replaces_a_file_whole_and_writes_devices_in_place(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "json"
    folder.mkdir()
    target = folder / "estimate.json"
    target.write_text("old\n")
    os.chmod(target, 0o640)
    assert main(["estimate", *TINY, "--json", str(target)]) == 0
    assert set(json.loads(target.read_text())) >= {"estimated", "measured"}
    assert (os.stat(target).st_mode & 0o777, os.listdir(folder)) == (0o640, ["estimate.json"])
    assert main(["estimate", *TINY, "--json", "/dev/null"]) == 0  # a device is written, never replaced
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    capsys.readouterr()


# the same estimate twice in one process, the second under a 300-byte file size limit (the data set cached by the
# first): only the JSON file is larger, so its write fails with EFBIG
CHILD = """
import resource, signal, sys
from trainer_ext.cli.main import main
assert main(sys.argv[1:-2]) == 0
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(300)
def test_a_write_that_fails_midway_keeps_the_old_file(tmp_path: Path) -> None:
    folder = tmp_path / "json"
    folder.mkdir()
    target = folder / "estimate.json"
    target.write_text('{"old": true}\n')
    argv = ["estimate", *TINY, "--json", str(target)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"error: --json {target} cannot be written: File too large" in done.stderr
    assert target.read_text() == '{"old": true}\n' and os.listdir(folder) == ["estimate.json"]
