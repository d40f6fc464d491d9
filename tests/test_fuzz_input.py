"""Property-based fuzzing of what users type: ``trainer-ext train --config`` files and flags, and launch configs.

Random keys (real field names and junk), random value types (None, booleans, huge and negative integers,
NaN and infinities, odd strings, lists, mappings, deep nesting), YAML, JSON and raw bytes. Every input must end
with exit 0, or exit 2 and exactly one ``error:`` line (the launcher: its one ``error: cannot launch`` heading),
never a traceback, and a refused job leaves no trace in a fresh ``--output_dir``.

YAML anchors, aliases (aliases of aliases, "billion laughs" of random width and depth, aliases inside their own
anchor, undefined ones, merge keys) and duplicate keys; special files (FIFOs, links to /dev/zero, folders, paths too
long, loops of links) in place of a config file: one error line, never a hang (a time limit guards those).

Bounded for CI: ``EXAMPLES`` examples per property (``TRAINER_EXT_FUZZ_EXAMPLES`` overrides), no deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis", reason="the dev extra installs hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.helpers.slowness import scaled  # noqa: E402
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


@st.composite
def aliased_yaml(draw: st.DrawFn, keys: list[str]) -> tuple[str, bool]:
    """YAML text of anchors, aliases (aliases of aliases, merges, undefined or self-referring ones) and keys that
    may repeat; and whether a top-level key repeats."""
    names = st.sampled_from(keys) | st.text(alphabet="abcdefgh_", min_size=1, max_size=4)
    kinds = ["scalar", "list", "list", "alias", "laughs", "laughs", "merge", "self", "undefined"]
    lines, anchors, used = [], [], []
    for i in range(draw(st.integers(min_value=1, max_value=6))):
        repeat = used and draw(st.integers(min_value=0, max_value=7)) == 0
        key = draw(st.sampled_from(used)) if repeat else draw(names)
        used.append(key)
        kind = draw(st.sampled_from(kinds[:-2] if draw(st.integers(0, 5)) else kinds))
        if kind == "laughs":  # levels of lists of aliases of the level before: width**levels values
            width, levels = draw(st.integers(min_value=2, max_value=9)), draw(st.integers(min_value=2, max_value=12))
            items = ["x"] * width
            for level in range(levels):
                lines.append(f"{json.dumps(f'{key}{level}')}: &l{i}_{level} [{', '.join(items)}]")
                items = [f"*l{i}_{level}"] * width
            anchors.append(f"l{i}_{levels - 1}")
            value = f"*l{i}_{levels - 1}"
        elif kind == "scalar":
            value = json.dumps(draw(scalars), allow_nan=True)
        elif kind == "list" or not anchors:
            width = draw(st.integers(min_value=1, max_value=9))
            items = [
                f"*{draw(st.sampled_from(anchors))}" if anchors and draw(st.booleans()) else "x" for _ in range(width)
            ]
            value = f"&a{i} [{', '.join(items)}]"
            anchors.append(f"a{i}")
        elif kind == "alias":
            value = f"*{draw(st.sampled_from(anchors))}"
        elif kind == "merge":
            value = f"{{<<: {{k: *{draw(st.sampled_from(anchors))}}}, {json.dumps(draw(names))}: 1}}"
        elif kind == "self":
            value = f"&s{i} [1, *s{i}]"
        else:
            value = "*nowhere"
        lines.append(f"{json.dumps(key)}: {value}")
    return "\n".join(lines) + "\n", len(set(used)) < len(used)


@pytest.mark.timeout(600)  # an alias bomb once took minutes: a bound that stops holding fails here, not hangs
@SETTINGS
@given(case=aliased_yaml(TRAIN_KEYS + LAUNCH_KEYS))
def test_yaml_aliases_and_duplicate_keys(capsys, case: tuple[str, bool]) -> None:
    from trainer_ext.config_files import MAX_NODES, parse_mapping
    from trainer_ext.errors import ConfigError

    text, repeats = case
    try:
        data = parse_mapping(text, "--config c.yaml")
    except ConfigError as error:
        assert "\n" not in str(error) or "is not valid YAML: line" in str(error), str(error)
    else:
        assert not repeats, text  # a key given twice is never silently resolved
        count, stack = 0, [data]
        while stack and count <= MAX_NODES:
            value = stack.pop()
            count += 1
            stack.extend(value.values() if isinstance(value, dict) else value if isinstance(value, list) else [])
        assert count <= MAX_NODES, text
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "c.yaml"
        config.write_text(text)
        for argv in (
            ["launch", "--config_file", str(config), "--dry_run", "train"],
            ["config", "validate", str(config)],
        ):
            code, said = _call(capsys, argv)
            assert "Traceback" not in said and code in (0, 2), (argv, said[-3000:])


SPECIAL = ["fifo", "link to /dev/zero", "/dev/null", "folder", "too long", "loop of links", "dangling link"]


def _special_file(folder: Path, kind: str) -> Path:
    """A path in ``folder`` that is ``kind`` instead of a config file."""
    path = folder / "c.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "/dev/null":
        path.symlink_to("/dev/null")
    elif kind == "folder":
        path.mkdir()
    elif kind == "too long":
        path = folder / ("c" * 300 + ".yaml")
    elif kind == "loop of links":
        path.symlink_to(path)
    else:
        path.symlink_to(folder / "gone.yaml")
    return path


@contextlib.contextmanager
def _unblocking(path: Path, seconds: float) -> Iterator[None]:
    """Hang guard for a FIFO: after ``seconds``, a writer opens and closes it now and then, so a reader blocked in
    open() reads end of file (and the test fails) instead of waiting forever; hypothesis repeats a failing example,
    which a one-shot time limit would not survive."""
    stop = threading.Event()

    def unblock() -> None:
        if stop.wait(seconds):
            return
        while not stop.wait(0.2):
            with contextlib.suppress(OSError):  # ENXIO: no reader waiting right now
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    thread = threading.Thread(target=unblock, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@pytest.mark.timeout(600)  # a FIFO once blocked every reader forever
@SETTINGS
@given(kind=st.sampled_from(SPECIAL), reader=st.sampled_from(["train", "launch", "validate"]))
def test_special_files_as_config_files(capsys, monkeypatch, kind: str, reader: str) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        path, out = str(_special_file(Path(tmp), kind)), Path(tmp) / "out"
        argv = {
            "train": ["train", "--config", path, "--output_dir", str(out), *QUICK],
            "launch": ["launch", "--config_file", path, "--dry_run", "train"],
            "validate": ["config", "validate", path],
        }[reader]
        with _unblocking(Path(path), scaled(10)) if kind == "fifo" else contextlib.nullcontext():
            code, said = _call(capsys, argv)
        assert code == 2 and "Traceback" not in said, (argv, said[-3000:])
        assert len([line for line in said.splitlines() if line.startswith("error:")]) == 1, (argv, said[-3000:])
        assert not out.exists()
