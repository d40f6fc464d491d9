"""``trainer-ext config validate``: every kind of config file the project ships, checked by the reader that reads it."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from tests.helpers.groups import no_group_left  # noqa: F401
from tests.helpers.paths import CONFIGS, ROOT
from trainer_ext.cli.main import main

# every config file; a model folder's stand-in tokenizer.json (configs/estimate/*/) is a tokenizer, not a config
SHIPPED = sorted(
    p for p in CONFIGS.rglob("*") if p.suffix in (".yaml", ".yml", ".json") and p.name != "tokenizer.json"
)
KIND_OF_FOLDER = {
    "fsdp": "an FSDP config",
    "deepspeed": "a DeepSpeed config",
    "examples": "a train config",
    "launch": "a launch config",
    "estimate": "a model config",
    "qwen2.5-0.5b": "a model config",
    "llama-3.1-8b-instruct": "a model config",
    "recipes": "a train config",
    "tiny": "a train config",
}
# recipes that start from another recipe's output folder: validated where that folder exists
STARTS_FROM = {"recipes/dpo.yaml": "outputs/recipes/sft_fsdp", "recipes/tiny/dpo.yaml": "outputs/recipes/sft"}

# parsing an FSDP train config in this process starts a group of one: torn down after each test
pytestmark = pytest.mark.usefixtures("no_group_left")


def _peft_findable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The LoRA recipes' flags check that peft can be found (nothing imports it): a stand-in where it is missing,
    once transformers (which imports peft where it finds it) is loaded."""
    import trainer_ext.job.arguments  # noqa: F401

    if importlib.util.find_spec("peft") is None:
        stand_in = types.ModuleType("peft")
        stand_in.__spec__ = importlib.machinery.ModuleSpec("peft", None)
        monkeypatch.setitem(sys.modules, "peft", stand_in)


def test_every_config_file_we_ship_is_found() -> None:
    assert {p.parent.name for p in SHIPPED} >= set(KIND_OF_FOLDER)


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(CONFIGS)) for p in SHIPPED])
def test_every_shipped_config_validates_as_its_kind(path: Path, capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.chdir(ROOT)  # train configs name files relative to the repository, as their comments say
    if "lora" in path.stem:
        _peft_findable(monkeypatch)
    name = str(path.relative_to(ROOT))
    start = STARTS_FROM.get(str(path.relative_to(CONFIGS)))
    if start:  # run where the recipe it follows has written its model
        (tmp_path / start).mkdir(parents=True)
        monkeypatch.chdir(tmp_path)
        name = str(path)
    code = main(["config", "validate", name])
    out = capsys.readouterr().out
    assert code == 0, out
    first = out.splitlines()[0]
    kind = KIND_OF_FOLDER.get(path.parent.name, "")
    assert kind, f"add {path.parent.name!r} to KIND_OF_FOLDER"
    assert first.startswith(f"{name}: OK as {kind}") and "told by its keys" in first, first
    assert "problem" not in out and "unknown key" not in out


def test_an_fsdp_preset_shows_the_settings_train_applies(capsys) -> None:
    assert main(["config", "validate", str(CONFIGS / "fsdp" / "shard_grad_op.yaml")]) == 0
    out = capsys.readouterr().out
    assert "reshard_after_forward          False" in out and "auto_wrap_policy               transformer" in out


def test_each_kind_reports_the_problem_its_reader_finds(tmp_path: Path, capsys) -> None:
    cases = {
        "fsdp.yaml": ("version: 2\nauto_wrap_polcy: SIZE_BASED_WRAP\nreshard_after_forward: false\n", "an FSDP"),
        "ds.json": (json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 4}}), "a DeepSpeed"),
        "train.yaml": ("task: causal-lm\nlearning_rat: 1.0e-3\nnum_train_epochs: 1\n", "a train"),
        "model.json": (json.dumps({"model_type": "lama", "hidden_size": 64, "num_hidden_layers": 2}), "a model"),
    }
    words = {
        "fsdp.yaml": "unknown key 'auto_wrap_polcy'. Did you mean 'auto_wrap_policy'",
        "ds.json": "unknown ZeRO stage 4",
        "train.yaml": "unknown key 'learning_rat'",
        "model.json": "model_type 'lama' is not one transformers knows (e.g. llama, gpt2, bert). Did you mean 'llama'",
    }
    for name, (text, kind) in cases.items():
        (tmp_path / name).write_text(text)
        assert main(["config", "validate", str(tmp_path / name)]) == 2, name
        out = capsys.readouterr().out
        assert out.startswith(f"{tmp_path / name}: 1 problem(s) as {kind} config"), out
        assert words[name] in out, out


def test_kind_chooses_the_reader(tmp_path: Path, capsys) -> None:
    path = tmp_path / "mixed.yaml"
    path.write_text("gradient_accumulation_steps: 4\n")  # a launch key, a train flag and a DeepSpeed key
    assert main(["config", "validate", str(path)]) == 0
    assert "OK as a launch config" in capsys.readouterr().out  # a tie goes to what a YAML file usually is
    assert main(["config", "validate", "--kind", "train", str(path)]) == 0
    out = capsys.readouterr().out
    assert "OK as a train config (trainer-ext train --config)\n" in out and "told by its keys" not in out
    assert main(["config", "validate", "--kind", "fsdp", str(CONFIGS / "deepspeed" / "zero2.json")]) == 2
    assert "unknown key 'train_micro_batch_size_per_gpu'" in capsys.readouterr().out


def one_error_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_an_unknown_kind_or_a_file_of_no_kind_is_one_line_naming_the_kinds(tmp_path: Path, capsys) -> None:
    err = one_error_line(capsys, ["config", "validate", "--kind", "fdsp", str(CONFIGS / "fsdp" / "full_shard.yaml")])
    assert "unknown kind 'fdsp'; the kinds are launch, fsdp, deepspeed, train, model. Did you mean 'fsdp'?" in err
    other = tmp_path / "other.yaml"
    other.write_text("colour: blue\nsize: 3\n")
    err = one_error_line(capsys, ["config", "validate", str(other)])
    assert f"cannot tell which kind of config {other} is: none of its keys (colour, size)" in err
    assert "the kinds are launch, fsdp, deepspeed, train, model (pass --kind KIND)" in err
    (tmp_path / "empty.yaml").write_text("")
    assert "it is empty" in one_error_line(capsys, ["config", "validate", str(tmp_path / "empty.yaml")])
    assert main(["config", "validate", "--kind", "launch", str(tmp_path / "empty.yaml")]) == 0


def test_a_yaml_error_is_shown_with_its_line_and_caret(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\n  use_cpu: true\n")
    assert main(["config", "validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"error: config file {bad} is not valid YAML: line 3, column 10: mapping values are not allowed here",
        "      use_cpu: true",
        "             ^",
    ]
    assert main(["config", "validate", "--kind", "launch", str(bad)]) == 2  # listed as a problem, caret kept
    out = capsys.readouterr().out
    assert "\n  - launch config" in out and "\n          use_cpu: true\n                 ^" in out, out


@pytest.mark.parametrize(
    "text",
    ["bf16: true\ngradient_accumulation_steps: 2\n", "activation_checkpointing: true\n"],
    ids=["ds-keys", "fsdp"],
)
def test_a_yaml_file_whose_keys_fit_several_kinds_is_a_train_config(text: str, tmp_path: Path, capsys) -> None:
    """DeepSpeed reads JSON only, and a tie between train and FSDP goes to train."""
    path = tmp_path / "job.yaml"
    path.write_text(text)
    assert main(["config", "validate", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"{path}: OK as a train config")
