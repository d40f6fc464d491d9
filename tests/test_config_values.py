"""The leaf readers every config path shares: YAML/JSON mappings, booleans, byte sizes, the launcher's variables."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from trainer_ext import env_vars
from trainer_ext.config_files import JSON, load_mapping, parse_mapping
from trainer_ext.errors import ConfigError
from trainer_ext.values import format_size, is_true, parse_bool, parse_size

PACKAGE = Path(__file__).resolve().parents[1] / "trainer_ext"


# -- config files -----------------------------------------------------------------------------------
def test_yaml_and_json_files_by_suffix(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("lr: 0.1\nname: x\n")
    (tmp_path / "b.JSON").write_text('{"lr": 0.1}')
    (tmp_path / "empty.yml").write_text("")
    assert load_mapping(tmp_path / "a.yaml", "--config") == {"lr": 0.1, "name": "x"}
    assert load_mapping(tmp_path / "b.JSON", "--config") == {"lr": 0.1}
    assert load_mapping(tmp_path / "empty.yml", "--config") == {}


def test_home_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.yaml").write_text("a: 1\n")
    assert load_mapping("~/c.yaml", "launch config") == {"a": 1}


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("bad.yaml", "a: [\n", r"^--config .*bad\.yaml is not valid YAML: "),
        ("bad.json", '{"a": 1,}', r"^--config .*bad\.json is not valid JSON: line 1, column 9: "),
        ("list.yaml", "- 1\n", r"must hold a mapping of keys to values, not list$"),
        ("list.json", "[1]", r"must hold a JSON object \(\{\.\.\.\}\), not list$"),
        ("null.json", "null", r"must hold a JSON object"),
    ],
)
def test_unreadable_files_are_one_config_error(tmp_path: Path, name: str, text: str, message: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_mapping(tmp_path / name, "--config")


def test_a_yaml_error_keeps_the_line_and_the_caret_under_it(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text("learning_rate: 1.0e-3\nnum_train_epochs: 3\n  seed: 1\n")
    with pytest.raises(ConfigError) as caught:
        load_mapping(tmp_path / "run.yaml", "--config")
    first, line, caret = str(caught.value).split("\n")
    assert first.endswith("run.yaml is not valid YAML: line 3, column 7: mapping values are not allowed here")
    assert (line, caret) == ("      seed: 1", "          ^")  # indented four, the caret under the colon


def test_a_yaml_error_at_the_end_points_at_where_the_construct_started() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_mapping('a: 1\nb: "unclosed\n', "--config x.yaml")
    assert str(caught.value).split("\n") == [
        "--config x.yaml is not valid YAML: line 3, column 1: found unexpected end of stream "
        "(while scanning a quoted scalar at line 2, column 4)",
        '    b: "unclosed',
        "       ^",
    ]


def test_missing_directory_and_wrong_type(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^DeepSpeed config .*nope\.json does not exist \(no such file\); see x$"):
        load_mapping(tmp_path / "nope.json", "DeepSpeed config", hint="; see x")
    with pytest.raises(ConfigError, match="is a directory, not a config file"):
        load_mapping(tmp_path, "--fsdp_config")
    (tmp_path / "run.txt").write_text("a: 1\n")
    with pytest.raises(ConfigError, match=r"run\.txt: unsupported file type; use \.yaml, \.json"):
        load_mapping(tmp_path / "run.txt", "--config", suffixes=(".yaml", ".json"))


def test_a_forced_format_ignores_the_suffix(tmp_path: Path) -> None:
    (tmp_path / "ds.conf").write_text('{"a": 1}')
    assert load_mapping(tmp_path / "ds.conf", "DeepSpeed config", fmt=JSON) == {"a": 1}
    (tmp_path / "ds.yaml").write_text("a: 1\n")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_mapping(tmp_path / "ds.yaml", "DeepSpeed config", fmt=JSON)


def test_duplicate_keys_are_refused_only_when_asked() -> None:
    text = '{"a": {"b": 1, "b": 2}}'
    assert parse_mapping(text, "inline JSON", fmt=JSON) == {"a": {"b": 2}}  # JSON's own rule: the last one
    with pytest.raises(ConfigError, match=r"^inline JSON is not valid: duplicate key 'b'; keep one of them$"):
        parse_mapping(text, "inline JSON", fmt=JSON, unique_keys=True)


# -- booleans ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("word", [True, "true", "Yes", " on ", "1", 1, "y", "T"])
def test_true_words(word) -> None:
    assert parse_bool(word) is True and is_true(word) is True


@pytest.mark.parametrize("word", [False, "false", "NO", "off", "0", 0, "n", "f"])
def test_false_words(word) -> None:
    assert parse_bool(word) is False and is_true(word) is False


def test_other_words_are_config_errors_or_not_true() -> None:
    with pytest.raises(ConfigError, match=r"^'maybe' is not true or false$"):
        parse_bool("maybe")
    with pytest.raises(ConfigError, match=r"^fsdp_config: xla must be true or false, got 2$"):
        parse_bool(2, "fsdp_config: xla")
    assert not is_true("maybe") and not is_true(None) and not is_true("")


# -- sizes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5GB", 5 * 10**9),  # huggingface_hub / transformers: GB is decimal
        ("5GiB", 5 * 2**30),  # ... GiB is binary
        ("10 kb", 10_000),  # any case, bytes (never bits)
        ("1.5GB", 1_500_000_000),
        ("2MiB", 2 * 2**20),
        ("512Mi", 512 * 2**20),  # the Kubernetes spelling of MiB
        ("1TB", 10**12),
        ("1TiB", 2**40),
        ("100B", 100),
        ("2048", 2048),
        (512, 512),
        (1.5e3, 1500),
    ],
)
def test_sizes(text, expected) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(("text", "decimal", "binary"), [("2G", "2GB", "2GiB"), ("512m", "512MB", "512MiB")])
def test_a_bare_unit_letter_is_refused_as_ambiguous(text: str, decimal: str, binary: str) -> None:
    """'2G' is 2 GiB to Slurm and 2*10**9 bytes to Kubernetes; transformers and accelerate refuse it too."""
    with pytest.raises(ConfigError, match="is ambiguous") as info:
        parse_size(text, "shard size")
    assert str(info.value).startswith(f"cannot read the shard size {text!r}")
    assert f"'{decimal}'" in str(info.value) and f"'{binary}'" in str(info.value)


@pytest.mark.parametrize("bad", ["2 bananas", "GB", "", "-1GB", True, -5])
def test_bad_sizes_are_config_errors(bad) -> None:
    with pytest.raises(ConfigError, match="memory size"):
        parse_size(bad, "memory size")


def test_format_size() -> None:
    assert [format_size(n) for n in (512, 2048, 3 * 2**20, 1.5 * 2**30)] == ["512 B", "2.0 KiB", "3.0 MiB", "1.50 GiB"]


def test_the_size_parser_reads_what_the_formatter_writes() -> None:
    assert parse_size(format_size(3 * 2**20).replace(" ", "")) == 3 * 2**20


# -- one of each ------------------------------------------------------------------------------------
def test_the_leaf_modules_import_nothing_of_trainer_ext_but_errors() -> None:
    for name in ("config_files", "values", "env_vars"):
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        relative = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level}
        absolute = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names} | {
            node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and not node.level
        }
        assert relative <= {"errors"}, (name, relative)
        assert not [m for m in absolute if m and m.startswith("trainer_ext") and m != "trainer_ext.errors"], name


def test_the_launcher_variables_are_named_once() -> None:
    """Only env_vars.py spells the variables the launcher exports; everyone else imports the names."""
    ours = (env_vars.MIXED_PRECISION, env_vars.GRADIENT_ACCUMULATION_STEPS, env_vars.CONFIG_FILE)
    spelled = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in ours
    }
    assert spelled == {"env_vars.py"}
