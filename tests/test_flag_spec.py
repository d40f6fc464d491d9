"""``trainer-ext train``'s flags as data: the shipped spec is current, answers like the real parser, and lets
``--help`` and bad input answer before torch is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from trainer_ext.errors import ConfigError
from trainer_ext.job import flag_spec
from trainer_ext.job.flag_help import GROUPS, HELP_ALL, render
from trainer_ext.job.flag_spec import SHIPPED, check_argv, load_spec, spec_flags, spec_from_parser, spec_key
from trainer_ext.job.flags import build_parser, parse_train_values

FLAGS = spec_flags(spec_from_parser(build_parser()))

VALID = [
    [],
    ["--max_steps", "5", "--learning-rate", "1e-3"],
    ["--max_steps=5", "--bf16", "--fp16", "false", "--report_to", "none"],
    ["--adam_beta1", "-0.5", "--warmup_steps", "0.1"],
    ["--no_report_plots", "--no-save-final-model", "--lr_scheduler_type", "cosine"],
    ["--debug", "underflow_overflow", "--label_names", "a", "b", "--seed", "3"],
    ["--lr_scheduler_kwargs", '{"num_cycles": 2}', "--optim", "sgd"],
]
INVALID = [
    ["--bogus", "1"],
    ["--max_step", "5"],
    ["--max_steps", "five"],
    ["--learning_rate", "x"],
    ["--lr_scheduler_type", "cosin"],
    ["--bf16", "maybe"],
    ["stray"],
    ["--max_steps"],
    ["--no_report_plots=1"],
    ["--learning_rate", "-1e-3"],  # argparse reads only -N and -N.N as numbers: this one is a flag
]


def _skip_unless_the_shipped_spec_is_current() -> None:
    """On another transformers the first answer rebuilds the spec (torch imported once, then cached)."""
    shipped = json.loads(SHIPPED.read_text(encoding="utf-8"))
    if shipped["key"]["transformers"] != spec_key()["transformers"]:
        pytest.skip(f"the shipped spec is for transformers {shipped['key']['transformers']}")


def test_the_shipped_spec_is_the_parsers() -> None:
    """Regenerate with ``python -m trainer_ext.job.flags`` after changing a flag (this test says so when stale)."""
    _skip_unless_the_shipped_spec_is_current()
    shipped = json.loads(SHIPPED.read_text(encoding="utf-8"))
    fresh = spec_from_parser(build_parser())
    assert shipped == json.loads(json.dumps(fresh)), "stale: run python -m trainer_ext.job.flags"


@pytest.mark.parametrize("argv", VALID, ids=" ".join)
def test_what_the_parser_accepts_the_spec_accepts(argv: list[str]) -> None:
    values, extras, _ = parse_train_values(argv)
    assert extras == []
    check_argv(argv, FLAGS)


@pytest.mark.parametrize("argv", INVALID, ids=" ".join)
def test_what_the_parser_refuses_the_spec_refuses(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        values, extras, _ = parse_train_values(argv)
        if extras:
            raise ConfigError("extras")
    with pytest.raises(ConfigError) as caught:
        check_argv(argv, FLAGS)
    assert "\n" not in str(caught.value)


def test_an_unknown_flag_gets_the_same_words_on_both_paths() -> None:
    from trainer_ext.job.flags import parse_train_args

    with pytest.raises(ConfigError) as slow:
        parse_train_args(["--max_step", "5"])
    with pytest.raises(ConfigError) as fast:
        check_argv(["--max_step", "5"], FLAGS)
    assert str(slow.value) == str(fast.value)
    assert "Did you mean --max_steps" in str(fast.value)


def test_a_stale_spec_is_rebuilt_once_then_read_from_the_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(flag_spec, "SHIPPED", tmp_path / "missing.json")
    monkeypatch.setenv(flag_spec.CACHE_DIR_ENV, str(tmp_path / "cache"))
    built = []

    def build():
        built.append(1)
        return build_parser()

    first = load_spec(build)
    second = load_spec(build)
    assert built == [1]
    assert first == second == FLAGS
    assert load_spec(None) == FLAGS  # from the cache, no builder needed


def test_help_groups_the_job_flags_first_and_states_one_default_per_flag() -> None:
    page = render(FLAGS, width=100)
    everything = render(FLAGS, everything=True, width=100)
    titles = [f"{title}:" for title, _ in GROUPS]
    positions = [page.index(f"\n{t}\n") for t in titles]
    assert positions == sorted(positions)
    assert page.index("--model_name_or_path") < page.index("--learning_rate") < page.index("--logging_steps")
    assert "--hub_model_id" not in page and "--hub_model_id" in everything
    assert f"trainer-ext train {HELP_ALL}" in page
    assert len(page.splitlines()) < len(everything.splitlines()) / 1.5
    for flag in FLAGS:  # each flag once in the full page, --no_x beside its positive flag, never its own entry
        assert everything.count(f"\n  {flag.name} ") + everything.count(f"\n  {flag.name}\n") == 1, flag.name
    entries = everything.split("\n  --")
    assert not [e for e in entries if e.lower().count("default") > 1 and "(default:" in e]
    assert "  --no_report_plots" not in everything and "--report_plots [BOOL], --no_report_plots" in everything


def _run_cli(*argv: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    """``trainer-ext`` in a fresh interpreter that reports whether torch or transformers got imported."""
    code = textwrap.dedent(
        f"""
        import sys
        from trainer_ext.cli.main import main
        code = main({list(argv)!r})
        heavy = sorted(m for m in ("torch", "transformers", "datasets") if m in sys.modules)
        print("HEAVY:" + ",".join(heavy))
        sys.exit(code)
        """
    )
    env = {**os.environ, flag_spec.CACHE_DIR_ENV: os.path.join(cwd or ".", ".cache")}  # never the user's cache
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "argv, code, words",
    [
        (["train", "--help"], 0, "the job: task, model, data:"),
        (["train", HELP_ALL], 0, "--hub_model_id"),
        (["train", "--max_stepz", "3"], 2, "error: unknown flag --max_stepz. Did you mean --max_steps or"),
        (["train", "--lr_scheduler_type", "cosin"], 2, "Did you mean 'cosine'?"),
        (["train", "--max_steps", "ten"], 2, "error: --max_steps takes a whole number, got 'ten'"),
        (["train", "--train_file", "missing.jsonl"], 2, "error: --train_file 'missing.jsonl': no such file."),
        (["train", "--model_config", "tiny-bret"], 2, "Did you mean 'tiny-bert'"),
        (["train", "--task", "regression"], 2, "error: unknown --task 'regression'"),
        (["--help"], 0, "usage: trainer-ext"),
    ],
)
def test_help_and_bad_flags_answer_without_importing_torch(argv, code, words, tmp_path) -> None:
    _skip_unless_the_shipped_spec_is_current()
    proc = _run_cli(*argv, cwd=str(tmp_path))
    assert proc.returncode == code, proc.stderr
    assert words in proc.stdout + proc.stderr
    assert proc.stdout.endswith("HEAVY:\n"), proc.stdout[-200:]
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(600)
def test_a_config_files_unknown_key_is_refused_before_torch(tmp_path) -> None:
    _skip_unless_the_shipped_spec_is_current()
    config = tmp_path / "job.yaml"
    config.write_text("max_steps: 3\nlearning_rat: 0.1\n")
    proc = _run_cli("train", "--config", str(config), cwd=str(tmp_path))
    assert proc.returncode == 2
    assert f"unknown key 'learning_rat' in config file {str(config)!r}. Did you mean 'learning_rate'?" in proc.stderr
    assert proc.stdout.endswith("HEAVY:\n")
    assert [p for p in tmp_path.iterdir() if p.name != ".cache"] == [config], "nothing written"


@pytest.mark.timeout(600)
def test_a_config_files_value_of_another_shape_is_left_to_the_full_parse(tmp_path) -> None:
    """The early check refuses only what it is sure of: a number written as text goes on to the real parser."""
    config = tmp_path / "job.yaml"
    config.write_text("max_steps: 1\nmax_train_samples: '40'\nvalidation_split_percentage: 500\n")
    proc = _run_cli("train", "--config", str(config), "--output_dir", str(tmp_path / "out"), cwd=str(tmp_path))
    assert proc.returncode == 2
    assert "validation_split_percentage must be in [0, 100)" in proc.stderr
