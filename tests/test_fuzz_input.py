"""Property-based fuzzing of what users type: ``trainer-ext train --config`` files and flags, and launch configs.

Random keys (real field names and junk), random value types (None, booleans, huge and negative integers,
NaN and infinities, odd strings, lists, mappings, deep nesting), YAML, JSON and raw bytes. Every input must end
with exit 0, or exit 2 and exactly one ``error:`` line (the launcher: its one ``error: cannot launch`` heading),
never a traceback, and a refused job leaves no trace in a fresh ``--output_dir``.

Bounded for CI: ``EXAMPLES`` examples per property (``TRAINER_EXT_FUZZ_EXAMPLES`` overrides), no deadline.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis", reason="the dev extra installs hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from trainer_ext.cli.main import main  # noqa: E402

EXAMPLES = int(os.environ.get("TRAINER_EXT_FUZZ_EXAMPLES", "60"))
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)
# flags that keep an accepted job to a couple of steps of the built-in demo; they override any config value
QUICK = ["--max_steps", "2", "--report_plots", "false", "--run_summary", "false", "--save_strategy", "no"]

TRAIN_KEYS = [
    "learning_rate",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "num_train_epochs",
    "gradient_accumulation_steps",
    "save_steps",
    "eval_steps",
    "logging_steps",
    "warmup_ratio",
    "warmup_steps",
    "weight_decay",
    "max_grad_norm",
    "seed",
    "task",
    "train_file",
    "validation_file",
    "report_to",
    "bf16",
    "fp16",
    "lr_scheduler_type",
    "optim",
    "eval_strategy",
    "max_seq_length",
    "metrics",
    "metrics_average",
    "num_labels",
    "text_column",
    "validation_split_percentage",
    "dataloader_num_workers",
    "label_smoothing_factor",
    "max_train_samples",
    "lora_r",
    "device_memory",
    "exact_eval_loss",
]
LAUNCH_KEYS = [
    "num_processes",
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "mixed_precision",
    "gpu_ids",
    "max_restarts",
    "rdzv_backend",
    "distributed_type",
    "use_cpu",
    "gradient_accumulation_steps",
    "deepspeed_config",
    "fsdp_config",
    "debug",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([0, 1, 2, -1, 7, 2**31, 2**63, 10**23]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["causal-lm", "sequence-classification", "none", "auto", "true", "1e-3", "8GiB", "", "\x00"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
deep = st.integers(min_value=60, max_value=3000).map(lambda n: "a: " + "[" * n + "]" * n + "\n")


def documents(keys: list[str]) -> st.SearchStrategy[bytes]:
    """A config file's bytes: YAML or JSON of random keys and values, deep nesting, or arbitrary bytes."""
    mapping = st.dictionaries(st.sampled_from(keys) | st.text(min_size=1, max_size=8), values, max_size=4)
    as_yaml = mapping.map(lambda m: yaml.safe_dump(m, allow_unicode=True).encode("utf-8"))
    as_json = mapping.map(lambda m: json.dumps(m).encode("utf-8"))
    top_level = values.map(lambda v: yaml.safe_dump(v).encode("utf-8"))  # a list or scalar instead of a mapping
    return st.one_of(as_yaml, as_yaml, as_json, top_level, deep.map(str.encode), st.binary(max_size=40))


def _call(capsys: pytest.CaptureFixture, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _check(code: int, said: str, argv: list[str]) -> None:
    assert "Traceback" not in said, (argv, said[-3000:])
    assert code in (0, 2), (code, argv, said[-3000:])
    if code == 2:
        errors = [line for line in said.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, (argv, said[-3000:])


@pytest.mark.slow
@SETTINGS
@given(document=documents(TRAIN_KEYS), suffix=st.sampled_from([".yaml", ".json", ".yml"]))
def test_train_config_files(capsys, monkeypatch, document: bytes, suffix: str) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a random model name must not reach for the network
    with tempfile.TemporaryDirectory() as tmp:
        config, out = Path(tmp) / f"c{suffix}", Path(tmp) / "out"
        config.write_bytes(document)
        argv = ["train", "--config", str(config), "--output_dir", str(out), *QUICK]
        code, said = _call(capsys, argv)
        _check(code, said, argv)
        if code == 2:
            assert not out.exists(), (document, said[-2000:])


flag_values = st.one_of(
    st.text(max_size=10),
    st.sampled_from(["inf", "-inf", "nan", "-1", "0", "1e400", "10000000000000000000000", "[1]", "{}", "", "1.5"]),
)


@pytest.mark.slow
@SETTINGS
@given(flags=st.lists(st.tuples(st.sampled_from(TRAIN_KEYS), flag_values), min_size=1, max_size=3))
def test_train_flags(capsys, monkeypatch, flags: list[tuple[str, str]]) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        argv = ["train", *[word for key, value in flags for word in (f"--{key}", value)]]
        argv += ["--output_dir", str(out), *QUICK]
        code, said = _call(capsys, argv)
        _check(code, said, argv)
        if code == 2:
            assert not out.exists(), (flags, said[-2000:])


@SETTINGS
@given(document=documents(LAUNCH_KEYS), suffix=st.sampled_from([".yaml", ".json"]))
def test_launch_config_files_dry_run(capsys, document: bytes, suffix: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / f"launch{suffix}"
        config.write_bytes(document)
        argv = ["launch", "--config_file", str(config), "--dry_run", "train"]
        code, said = _call(capsys, argv)
        _check(code, said, argv)
