"""The config file reader (trainer_ext.config_files) against hostile files: special files, sizes, YAML aliases.

Only regular files are read, at most a bounded number of bytes; a YAML document is checked once composed (unique
keys, aliases expanded to a bounded number of values) before anything is built. Each refusal is one ConfigError.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainer_ext.config_files import JSON, MAX_NODES, MAX_YAML_BYTES, load_mapping, parse_mapping
from trainer_ext.errors import ConfigError


def laughs(levels: int, width: int = 9) -> str:
    """A "billion laughs": each level a list of ``width`` aliases of the level before; width**levels values."""
    lines = ["l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


@pytest.mark.timeout(60)  # before the bound, 8 levels took 77 s and each level more nine times that
@pytest.mark.parametrize("levels", [6, 8, 12])
def test_alias_expansion_is_bounded_before_anything_is_built(levels: int) -> None:
    text = laughs(levels)
    assert len(text) < 1000
    with pytest.raises(ConfigError) as caught:
        parse_mapping(text, "--config run.yaml")
    assert _one_line(caught) == (
        f"--config run.yaml holds more than {MAX_NODES:,} values once its YAML aliases (*name) are expanded; "
        "write out what is repeated, or refer to fewer aliases"
    )


def test_aliases_and_merge_keys_within_the_budget_still_work() -> None:
    text = laughs(3) + "base: &b {lr: 0.1, seed: 1}\nrun:\n  <<: *b\n  seed: 2\n"
    data = parse_mapping(text, "--config run.yaml")
    assert data["l2"] == [[["lol"] * 9] * 9] * 9
    assert data["run"] == {"lr": 0.1, "seed": 2}  # a key may override what a merge brings


def test_an_alias_inside_its_own_anchor_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_mapping("a: 1\nloop: &x [1, *x]\n", "--config run.yaml")
    assert "the YAML anchor at line 2 is used inside itself" in _one_line(caught)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (
            "learning_rate: 0.1\nseed: 1\nlearning_rate: 0.2\n",
            "line 3: duplicate key 'learning_rate' (first at line 1)",
        ),
        ("fsdp:\n  a: 1\n  b: 2\n  a: 3\n", "line 4: duplicate key 'a' (first at line 2)"),
        ("a: {x: 1, x: 2}\n", "line 1: duplicate key 'x' (first at line 1)"),
        ("1: a\n0x1: b\n", "line 2: duplicate key 1 (first at line 1)"),  # two spellings of one key
    ],
)
def test_duplicate_yaml_keys_are_refused_naming_the_key_and_line(text: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_mapping(text, "--config run.yaml")
    assert _one_line(caught) == f"--config run.yaml is not valid YAML: {words}; keep one of them"


@pytest.mark.timeout(60)  # the old reader blocked in open() on a FIFO until a writer came
def test_special_files_are_refused_without_reading(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    (tmp_path / "null.json").symlink_to("/dev/null")
    for name, kind in [("fifo.yaml", "a FIFO (named pipe)"), ("zero.yaml", "a character device")]:
        with pytest.raises(ConfigError) as caught:
            load_mapping(tmp_path / name, "--config")
        assert _one_line(caught).endswith(
            f"{name} is {kind}, not a regular file; give the path of a YAML or JSON file"
        )
    with pytest.raises(ConfigError, match="null.json is a character device"):
        load_mapping(tmp_path / "null.json", "DeepSpeed config", fmt=JSON)


def test_a_file_over_the_size_bound_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_bytes(b"# padding\n" * (MAX_YAML_BYTES // 10 + 1))
    with pytest.raises(ConfigError) as caught:
        load_mapping(big, "--config")
    assert _one_line(caught).endswith(
        f"big.yaml is larger than {MAX_YAML_BYTES >> 10} KiB; a config file is a few KB of keys"
    )
    just = tmp_path / "just.yaml"
    just.write_bytes(b"a: 1\n" + b"#" * (MAX_YAML_BYTES - 6) + b"\n")
    assert load_mapping(just, "--config") == {"a": 1}


def test_paths_the_file_system_refuses_are_one_line(tmp_path: Path) -> None:
    long = tmp_path / ("a" * 300 + ".yaml")
    with pytest.raises(ConfigError) as caught:
        load_mapping(long, "--config")
    assert _one_line(caught).endswith(
        "the path is too long for the file system (File name too long); use a shorter path"
    )
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    with pytest.raises(ConfigError) as caught:
        load_mapping(tmp_path / "loop.yaml", "--config")
    assert "loop.yaml cannot be read: Too many levels of symbolic links" in _one_line(caught)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"file/c\.yaml does not exist \(no such file\)$"):
        load_mapping(tmp_path / "file" / "c.yaml", "--config")
