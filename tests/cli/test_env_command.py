"""``trainer-ext env``: versions, devices and the config in use, without importing optional packages."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

from trainer_ext.cli import env
from trainer_ext.cli.main import main


def test_report_lists_versions_devices_and_config(home, capsys, monkeypatch):
    config = home / ".cache" / "trainer_ext" / "default_config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("# comment\ndistributed_type: MULTI_CPU\nnum_processes: 2\nsame_network: true\n")
    real_version = metadata.version

    def version(name: str) -> str:
        if name in ("deepspeed", "peft"):
            raise metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(env.metadata, "version", version)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for line in ("- python: ", "- torch: ", "- NCCL: ", "- transformers: ", "- CPUs: ", "- RAM: ", "- GPUs: "):
        assert line in out
    assert "- deepspeed: not installed" in out and "- peft: not installed" in out
    assert f"- launch config: {config} (default location)" in out
    assert "  distributed_type: MULTI_CPU" in out and "# comment" not in out
    assert "ignored keys: same_network" in out


def test_env_never_imports_accelerate():
    code = "import sys; from trainer_ext.cli.main import main; main(['env']); assert 'accelerate' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "- accelerate: " in proc.stdout and "(never imported by trainer_ext)" in proc.stdout


def test_env_without_config_and_with_stray_arguments(capsys):
    assert "- launch config: none (" in env.report()
    assert main(["env", "extra"]) == 2
