"""LoRA flags of ``trainer-ext train``: defaults, config files, bad input and a missing peft, all without peft.

The real LoRA runs (which need peft) are in tests/with_peft/test_lora_cli_runs.py. Here a stand-in module makes
"peft is installed" true where a test only parses flags.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest

from trainer_ext.cli.main import main
from trainer_ext.errors import ConfigError
from trainer_ext.job.arguments import TrainJobArguments
from trainer_ext.job.flags import parse_train_args
from trainer_ext.job.lora_arguments import LORA_DROPOUT, PEFT_INSTALL, lora_targets

PEFT_IMPORTABLE = importlib.util.find_spec("peft") is not None


@pytest.fixture
def peft_present(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flags are checked as if peft were installed (nothing here imports it: parsing only looks for it)."""
    if not PEFT_IMPORTABLE:
        stand_in = types.ModuleType("peft")
        stand_in.__spec__ = importlib.machinery.ModuleSpec("peft", None)
        monkeypatch.setitem(sys.modules, "peft", stand_in)


@pytest.fixture
def peft_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """peft cannot be found or imported, whether or not this environment has it."""
    monkeypatch.setitem(sys.modules, "peft", None)


def test_lora_is_off_by_default() -> None:
    args = TrainJobArguments()
    assert (args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules, args.merge_lora) == (
        0,
        None,
        None,
        None,
        False,
    )
    assert "lora_r" not in args.fingerprint() and "lora_alpha" not in args.auto_filled


def test_defaults_alpha_twice_the_rank_and_a_little_dropout(peft_present: None, tmp_path: Path) -> None:
    args = parse_train_args(["--lora_r", "8", "--output_dir", str(tmp_path)])
    assert (args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules) == (8, 16, LORA_DROPOUT, None)
    assert args.auto_filled["lora_alpha"] == 16 and args.auto_filled["lora_dropout"] == LORA_DROPOUT
    own = parse_train_args(
        ["--lora_r", "4", "--lora_alpha", "32", "--lora_dropout", "0", "--output_dir", str(tmp_path)]
    )
    assert (own.lora_alpha, own.lora_dropout) == (32, 0.0)
    assert "lora_alpha" not in own.auto_filled and "lora_dropout" not in own.auto_filled


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("q_proj,v_proj", ["q_proj", "v_proj"]),
        (" q_proj , v_proj ,", ["q_proj", "v_proj"]),
        (["q_proj", "v_proj"], ["q_proj", "v_proj"]),
        ("query", ["query"]),
        ("all-linear", "all-linear"),
        ("ALL_LINEAR", "all-linear"),
        (["all-linear"], "all-linear"),
        (None, None),
    ],
)
def test_target_modules_from_a_flag_or_a_yaml_list_mean_the_same(value, expected) -> None:
    assert lora_targets(value) == expected


def test_a_config_file_with_the_lora_keys_equals_the_flags(peft_present: None, tmp_path: Path) -> None:
    config = tmp_path / "lora.yaml"
    config.write_text(
        f"output_dir: {tmp_path}\nlora_r: 8\nlora_alpha: 16\nlora_dropout: 0.1\n"
        "lora_target_modules: [query, value]\nmerge_lora: true\n"
    )
    from_file = parse_train_args(["--config", str(config)])
    from_flags = parse_train_args(
        [
            "--output_dir",
            str(tmp_path),
            "--lora_r",
            "8",
            "--lora_alpha",
            "16",
            "--lora_dropout",
            "0.1",
            "--lora_target_modules",
            "query,value",
            "--merge_lora",
        ]
    )
    keys = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "merge_lora")
    assert {k: getattr(from_file, k) for k in keys} == {k: getattr(from_flags, k) for k in keys}
    assert from_file.fingerprint() == from_flags.fingerprint()
    assert from_file.fingerprint()["lora_target_modules"] == ["query", "value"]
    overridden = parse_train_args(["--config", str(config), "--lora_r", "4"])  # the command line wins
    assert (overridden.lora_r, overridden.lora_alpha) == (4, 16)


def test_a_lora_job_is_a_different_job_from_a_full_fine_tune(peft_present: None, tmp_path: Path) -> None:
    full = parse_train_args(["--output_dir", str(tmp_path)]).fingerprint()
    lora = parse_train_args(["--output_dir", str(tmp_path), "--lora_r", "8"]).fingerprint()
    assert {k: v for k, v in lora.items() if not k.startswith("lora_")} == full
    assert (lora["lora_r"], lora["lora_target_modules"]) == (8, None)


def run_main(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora_r", "-4"], "--lora_r must be a rank of 1 or more (e.g. 8), or 0 for full fine-tuning; got -4"),
        (["--lora_r", "8", "--lora_dropout", "1"], "--lora_dropout must be in [0, 1), got 1.0"),
        (["--lora_r", "8", "--lora_dropout", "-0.1"], "--lora_dropout must be in [0, 1)"),
        (["--lora_r", "8", "--lora_alpha", "0"], "--lora_alpha must be positive, got 0"),
        (["--merge_lora"], "--merge_lora given without --lora_r: add --lora_r N (e.g. 8)"),
        (["--lora_alpha", "16", "--lora_dropout", "0"], "--lora_alpha, --lora_dropout given without --lora_r"),
        (["--lora_target_modules", "q_proj"], "--lora_target_modules given without --lora_r"),
        (["--lora_r", "8", "--lora_target_modules", ","], "names no module"),
        (["--lora_r", "8", "--lora_target_modules", "all-linear,q_proj"], "pass it alone"),
        (["--lora_r", "8", "--merge_lora", "--fsdp", "full_shard"], "drop --merge_lora and merge the saved adapter"),
        (
            ["--lora_r", "8", "--merge_lora", "--deepspeed", "configs/deepspeed/zero2.json"],
            "which FSDP and DeepSpeed do not give",
        ),
        (["--lora_rank", "8"], "unknown flag --lora_rank. Did you mean --local_rank or --lora_r"),
    ],
)
def test_bad_lora_flags_exit_2_with_one_line_and_write_nothing(
    peft_present: None, capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    out = tmp_path / "out"
    code, err = run_main(capsys, ["train", "--output_dir", str(out), *argv])
    assert code == 2, err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert not out.exists()


def test_bad_lora_values_are_checked_before_looking_for_peft(peft_missing: None) -> None:
    """A wrong value is reported as such wherever it runs, peft or not."""
    with pytest.raises(ConfigError, match="lora_dropout must be in"):
        TrainJobArguments(lora_r=8, lora_dropout=2.0)


def test_lora_without_peft_names_the_extra_to_install(
    peft_missing: None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    code, err = run_main(capsys, ["train", "--output_dir", str(out), "--lora_r", "8"])
    assert code == 2 and "Traceback" not in err
    assert err.startswith("error: --lora_r needs peft, which is not installed: ") and PEFT_INSTALL in err
    assert not out.exists()
    with pytest.raises(ConfigError, match="needs peft"):
        TrainJobArguments(lora_r=8)
    assert TrainJobArguments().lora_r == 0  # without LoRA flags peft is never looked for


@pytest.mark.skipif(PEFT_IMPORTABLE, reason="the main environment has no peft; this one does")
def test_the_cli_without_peft_exits_2_without_a_traceback(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer_ext", "train", "--lora_r", "8", "--merge_lora", "--output_dir", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "error: --lora_r needs peft, which is not installed: pip install 'peft>=0.14'" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_help_lists_the_lora_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--lora_r", "--lora_alpha", "--lora_dropout", "--lora_target_modules", "--merge_lora"):
        assert flag in out
    assert "all-linear" in out and "'peft>=0.14'" in out
