"""``trainer-ext checkpoint``: listed by ``trainer-ext --help``, its help and usage errors answered without torch.

Its work on real checkpoints is tested in tests/checkpointing/test_seal.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

from trainer_ext.cli.main import main


def test_the_command_is_listed(capsys) -> None:
    assert main(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:1] == ["checkpoint"] and "verify DIR" in line and "seal DIR" in line for line in lines)
    assert main(["checkpoint", "--help"]) == 0
    out = capsys.readouterr().out
    assert "verify" in out and "seal" in out


def test_usage_errors_are_one_line(capsys) -> None:
    for argv in (
        ["checkpoint"],
        ["checkpoint", "check", "x"],
        ["checkpoint", "seal"],
        ["checkpoint", "seal", "a", "b"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "trainer-ext checkpoint" in err, err


def test_help_and_usage_errors_import_no_torch() -> None:
    code = (
        "import json, sys\n"
        "from trainer_ext.cli.main import main\n"
        "codes = [main(['checkpoint', 'seal', '--help']), main(['checkpoint', 'verify'])]\n"
        "print(json.dumps([codes, 'torch' in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == [[0, 2], False]
