"""Model config values out of range are one error line (field, file, range, fix) before anything is built:
zero heads, negative, fractional, huge or non-numeric sizes, deep nesting, heads that do not divide the width, a
billion layers (which hung ``estimate``) and more than 10^13 parameters; ``estimate`` through the CLI, ``train``
once its model building calls the same check, and ``check_model_config`` on built configs; fuzzed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import transformers

from tests.helpers.paths import ROOT
from trainer_ext.cli.main import main
from trainer_ext.errors import ConfigError
from trainer_ext.job.model_limits import (
    MAX_LAYERS,
    MAX_PARAMETERS,
    check_config_values,
    check_model_config,
    load_model_config,
    parameters_at_least,
)

LLAMA = dict(
    model_type="llama",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    max_position_embeddings=128,
)
BERT = dict(
    model_type="bert", vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2
)
DEEP = "[" * 100_000 + "]" * 100_000

# (name, config.json text, words the one error line must hold)
HOSTILE = [
    ("zero heads", {**LLAMA, "num_attention_heads": 0}, ["num_attention_heads", "is 0", "from 1 to"]),
    ("negative layers", {**LLAMA, "num_hidden_layers": -2}, ["num_hidden_layers", "is -2", "from 0 to 1,024"]),
    ("fractional width", {**LLAMA, "hidden_size": 32.5}, ["hidden_size", "32.5", "not a whole number"]),
    ("exponent width", {**LLAMA, "hidden_size": 1e12}, ["hidden_size", "no point or exponent"]),
    ("huge integer width", {**LLAMA, "intermediate_size": 10**12}, ["intermediate_size", "too large", "1,048,576"]),
    ("infinite width", json.dumps(LLAMA)[:-1] + ', "hidden_size": 1e999}', ["hidden_size", "inf"]),
    ("400-digit vocabulary", {**LLAMA, "vocab_size": 10**400}, ["vocab_size", "401-digit", "16,777,216"]),
    ("5000-digit vocabulary", '{"model_type": "llama", "vocab_size": ' + "9" * 5000 + "}", ["not valid JSON"]),
    ("string width", {**LLAMA, "hidden_size": "abc"}, ["hidden_size", "'abc'", "not a number"]),
    ("boolean heads", {**LLAMA, "num_attention_heads": True}, ["num_attention_heads", "True"]),
    ("list of junk", {**LLAMA, "intermediate_size": [64, "x"]}, ["intermediate_size", "'x'"]),
    ("billion layers", {**LLAMA, "num_hidden_layers": 10**9}, ["num_hidden_layers", "1000000000", "1,024"]),
    ("billion layers as 1e9", {**LLAMA, "num_hidden_layers": 1e9}, ["num_hidden_layers", "1e+09"]),
    ("width not divisible", {**LLAMA, "hidden_size": 30}, ["hidden_size 30", "num_attention_heads 4", "multiple"]),
    ("gpt2 width", {"model_type": "gpt2", "n_embd": 30, "n_head": 4}, ["n_embd 30", "n_head 4"]),
    ("kv heads not dividing", {**LLAMA, "num_key_value_heads": 3}, ["num_key_value_heads 3", "divide"]),
    ("more kv heads than heads", {**LLAMA, "num_key_value_heads": 8}, ["num_key_value_heads 8", "divide"]),
    ("negative positions", {**LLAMA, "max_position_embeddings": -1}, ["max_position_embeddings", "-1"]),
    ("zero vocabulary", {**BERT, "vocab_size": 0}, ["vocab_size", "is 0"]),
    ("nested sub-config", {**LLAMA, "text_config": {"model_type": "llama", "hidden_size": -1}}, ["text_config."]),
    ("deep nesting", '{"model_type": "llama", "x": ' + DEEP + "}", ["nested more than"]),
    ("another field's type", {**LLAMA, "rms_norm_eps": "abc"}, ["rms_norm_eps", "cannot be read"]),
    ("not an object", "[1, 2]", ["JSON object"]),
    ("not JSON", '{"model_type": ', ["not valid JSON"]),
    (
        "ten trillion parameters",
        {**LLAMA, "hidden_size": 2**17, "intermediate_size": 2**19, "num_hidden_layers": 1024, "vocab_size": 2**20},
        ["parameters", "1e+13"],
    ),
]


def _write(folder: Path, content: dict | str, name: str = "config.json") -> Path:
    path = folder / name
    path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return path


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("data"), "the cat sat on the mat\nthe dog sat on the log\n", "data.txt")


@pytest.mark.timeout(120)  # a billion layers hung estimate: a regression fails here instead of hanging
@pytest.mark.parametrize(("case", "content", "words"), HOSTILE, ids=[case[0] for case in HOSTILE])
def test_estimate_refuses_a_hostile_model_config_in_one_line(
    tmp_path, capsys, text_file, case: str, content, words: list[str]
) -> None:
    config = _write(tmp_path, content)
    argv = ["estimate", "--model_config", str(config), "--task", "causal-lm", "--train_file", str(text_file)]
    assert main(argv) == 2
    err = _one_line(capsys)
    assert str(config) in err, err
    for word in words:
        assert word in err, (word, err)


def test_estimate_checks_a_folder_and_a_pretrained_folder_the_same_way(tmp_path, capsys, text_file) -> None:
    _write(tmp_path, {**LLAMA, "num_attention_heads": 0})
    for flag in ("--model_config", "--model_name_or_path"):
        assert main(["estimate", flag, str(tmp_path), "--task", "causal-lm", "--train_file", str(text_file)]) == 2
        err = _one_line(capsys)
        assert flag in err and str(tmp_path / "config.json") in err and "num_attention_heads" in err, err


def test_a_zero_layer_config_is_accepted(tmp_path, capsys, text_file) -> None:
    config = _write(tmp_path, {**LLAMA, "num_hidden_layers": 0})
    assert (
        main(["estimate", "--model_config", str(config), "--task", "causal-lm", "--train_file", str(text_file)]) == 0
    )
    assert ", 0 layers," in capsys.readouterr().out


@pytest.mark.parametrize(
    "config",
    [
        transformers.BertConfig(),
        transformers.GPT2Config(),
        transformers.LlamaConfig(num_key_value_heads=8),
        transformers.T5Config(),
        transformers.MixtralConfig(),
        transformers.AutoConfig.from_pretrained(ROOT / "configs" / "estimate" / "llama70b.json"),
    ],
    ids=lambda config: config.model_type,
)
def test_real_shapes_are_accepted(config: transformers.PretrainedConfig) -> None:
    check_model_config(config, "a test")
    assert 0 < parameters_at_least(config.to_dict()) < MAX_PARAMETERS


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_hidden_layers", -1), ("num_hidden_layers", MAX_LAYERS + 1), ("num_attention_heads", 0), ("vocab_size", 0)],
)
def test_check_model_config_refuses_a_built_config(field: str, value: int) -> None:
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"})
    setattr(config, field, value)
    with pytest.raises(ConfigError, match=rf"^{field} in the-file is {value} \(too (small|large)\)"):
        check_model_config(config, "the-file")


def test_a_built_config_with_too_many_labels_is_refused() -> None:
    config = transformers.BertConfig(num_labels=2**20 + 1)
    with pytest.raises(ConfigError, match="num_labels"):
        check_model_config(config, "x")


def test_the_gpt2_aliases_are_checked() -> None:
    config = transformers.GPT2Config()
    config.num_hidden_layers = -3  # attribute_map: n_layer
    with pytest.raises(ConfigError, match=r"^n_layer in x is -3"):
        check_model_config(config, "x")


def test_a_folder_without_config_json_is_one_line(tmp_path) -> None:
    with pytest.raises(ConfigError) as error:
        load_model_config(str(tmp_path))
    assert len(str(error.value).splitlines()) == 1


# --- train: the job's model building calls the same check (trainer_ext/job/run.py build_model / model_config) ------------

TRAIN = ["--task", "causal-lm", "--max_steps", "1", "--report_plots", "false", "--save_strategy", "no"]
TRAIN += ["--save_final_model", "false", "--run_summary", "false"]


TRAIN_CASES = [
    ("zero heads", {**LLAMA, "num_attention_heads": 0}, "num_attention_heads"),
    ("negative layers", {**LLAMA, "num_hidden_layers": -2}, "num_hidden_layers"),
    ("fractional width", {**LLAMA, "hidden_size": 32.5}, "hidden_size"),
    ("deep nesting", '{"model_type": "llama", "x": ' + DEEP + "}", "nested"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("case", "content", "field"), TRAIN_CASES, ids=[case[0] for case in TRAIN_CASES])
def test_train_refuses_a_hostile_model_config_before_training(
    tmp_path, capsys, text_file, case: str, content, field: str
) -> None:
    config = _write(tmp_path, content)
    out = tmp_path / "out"
    argv = ["train", "--model_config", str(config), "--train_file", str(text_file), "--output_dir", str(out), *TRAIN]
    assert main(argv) == 2
    err = _one_line(capsys)
    assert field in err and str(config) in err, err
    assert not any(name.endswith((".safetensors", ".bin")) for _, _, files in os.walk(out) for name in files)


# --- fuzz: any value in any size field is accepted or one ConfigError line, never another exception ---------------

hypothesis = pytest.importorskip("hypothesis", reason="the dev extra installs hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("TRAINER_EXT_FUZZ_EXAMPLES", "60"))
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)
FIELDS = ["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"]
FIELDS += ["vocab_size", "max_position_embeddings", "head_dim", "num_labels", "n_layer", "rms_norm_eps"]
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.integers(min_value=-4, max_value=4096),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(min_value=-4, max_value=300), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


@SETTINGS
@given(changes=st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=4))
def test_fuzzed_size_fields_are_accepted_or_one_line(changes: dict) -> None:
    values = {**LLAMA, **changes}
    try:
        check_config_values(values, "fuzz.json")
    except ConfigError as error:
        assert len(str(error).splitlines()) == 1 and "fuzz.json" in str(error)


@SETTINGS
@given(changes=st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=3))
def test_fuzzed_config_files_load_or_refuse_in_one_line(changes: dict) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = _write(Path(folder), {**LLAMA, **changes})
        try:
            config = load_model_config(str(path))
        except ConfigError as error:
            assert len(str(error).splitlines()) == 1 and str(path) in str(error), error
        else:
            check_model_config(config, "again")  # what was accepted stays accepted once built
