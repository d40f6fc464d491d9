"""load_checkpoint_and_dispatch on malformed and hostile checkpoint folders: every one is one ConfigError line,
an index never sends the loader outside its folder nor to a pickle, and a FIFO is never opened."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.inference.dispatch_models import llama_config, prompt
from trainer_ext.errors import ConfigError
from trainer_ext.inference import init_empty_weights, load_checkpoint_and_dispatch, loading

INDEX = "model.safetensors.index.json"
ROOT = Path(__file__).resolve().parents[2]


def _empty() -> LlamaForCausalLM:
    with init_empty_weights():
        return LlamaForCausalLM(llama_config())


def _load(path: Path, model: object = None) -> torch.nn.Module:
    return load_checkpoint_and_dispatch(model or _empty(), path, {"": "cpu"}, print_summary=False)


CHILD = """
import sys
from transformers import LlamaForCausalLM
from tests.inference.dispatch_models import llama_config
from trainer_ext.inference import init_empty_weights, load_checkpoint_and_dispatch
from trainer_ext.errors import ConfigError
for path in sys.argv[1:]:
    with init_empty_weights():
        model = LlamaForCausalLM(llama_config())
    try:
        load_checkpoint_and_dispatch(model, path, {"": "cpu"}, print_summary=False)
        print("loaded", flush=True)
    except ConfigError as error:
        print("ConfigError: " + str(error), flush=True)
"""


def _load_in_child(*paths: Path) -> list[str]:
    """What loading each path says, from a child process killed after two minutes: a FIFO opened would block
    forever (in native code, where no timeout in this process could interrupt it), so a regression fails, never
    hangs."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, *map(str, paths)], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"loading {paths} blocked for two minutes (a FIFO was opened)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()


@pytest.fixture
def sharded(checkpoints, tmp_path) -> Path:
    """A fresh copy of the sharded checkpoint, free to break."""
    folder = tmp_path / "sharded"
    shutil.copytree(checkpoints["sharded"], folder)
    return folder


def _index(folder: Path) -> dict:
    return json.loads((folder / INDEX).read_text())


def _first_shard(folder: Path) -> tuple[str, str]:
    name, file = next(iter(_index(folder)["weight_map"].items()))
    return name, file


def _set(folder: Path, name: str, value: object) -> None:
    index = _index(folder)
    index["weight_map"][name] = value
    (folder / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"[]", "has no 'weight_map'"),
        (b'{"weight_map": []}', "has no 'weight_map'"),
        (b"null", "has no 'weight_map'"),
        (b'{"weight_map": ', "invalid JSON"),
        (b"\xff\xfe\x00garbage", "invalid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid JSON"),
        (b'{"weight_map": {"a": ' * 50_000 + b"1" + b"}}" * 50_000, "invalid JSON"),
        (b"", "invalid JSON"),
    ],
)
def test_a_malformed_index_is_one_config_error(sharded, text, message):
    (sharded / INDEX).write_bytes(text)
    with pytest.raises(ConfigError, match=message) as caught:
        _load(sharded)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("value", [5, None, ["model-00001.safetensors"], {"file": "x"}, 1.5, True])
def test_a_weight_map_value_that_is_not_a_name(sharded, value):
    name, _ = _first_shard(sharded)
    _set(sharded, name, value)
    with pytest.raises(ConfigError, match=rf"weight_map\['{name}'\] must be a file name"):
        _load(sharded)


def test_an_index_naming_a_pickle_is_refused_unread(sharded):
    """A pickle that would run code when loaded: the index naming it is refused before the file is touched."""
    name, _ = _first_shard(sharded)
    torch.save({name: torch.zeros(1)}, sharded / "pytorch_model.bin")
    os.chmod(sharded / "pytorch_model.bin", 0)  # unreadable: a read attempt would fail differently
    _set(sharded, name, "pytorch_model.bin")
    with pytest.raises(ConfigError, match="'pytorch_model.bin' .* not a .safetensors file .pickled weights are never"):
        _load(sharded)


@pytest.mark.parametrize("where", ["absolute", "parent", "nested parent", "empty"])
def test_an_index_naming_a_file_outside_its_folder_is_refused(sharded, tmp_path, where):
    """Before, an absolute name was joined as itself and loaded: the weights came from anywhere on the disk."""
    name, file = _first_shard(sharded)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(sharded / file, outside / file)  # a valid shard, so only the place is wrong
    value = {
        "absolute": str(outside / file),
        "parent": f"../elsewhere/{file}",
        "nested parent": f"sub/../../elsewhere/{file}",
        "empty": "",
    }[where]
    _set(sharded, name, value)
    with pytest.raises(ConfigError, match="outside the checkpoint folder"):
        _load(sharded)


def test_a_subfolder_inside_the_checkpoint_is_still_fine(sharded):
    """Names in a subfolder of the checkpoint stay allowed: only leaving the folder is refused."""
    reference = _load(sharded)
    index = _index(sharded)
    (sharded / "part").mkdir()
    for file in set(index["weight_map"].values()):
        shutil.move(sharded / file, sharded / "part" / file)
    index["weight_map"] = {k: f"part/{v}" for k, v in index["weight_map"].items()}
    (sharded / INDEX).write_text(json.dumps(index))
    loaded = _load(sharded)
    ids = prompt()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("kind", ["fifo", "zero", "folder", "missing", "garbage", "truncated", "dangling"])
def test_a_shard_that_is_not_a_safetensors_file(sharded, kind):
    _, file = _first_shard(sharded)
    shard = sharded / file
    data = shard.read_bytes()
    shard.unlink()
    if kind == "fifo":
        os.mkfifo(shard)  # opened, it would block forever
    elif kind == "zero":
        shard.symlink_to("/dev/zero")
    elif kind == "folder":
        shard.mkdir()
    elif kind == "garbage":
        shard.write_bytes(b"\x00" * 64)
    elif kind == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    elif kind == "dangling":
        shard.symlink_to(sharded / "gone.safetensors")
    message = {
        "fifo": "is a FIFO",
        "zero": "is a device or socket",
        "folder": "is a folder",
        "missing": "is missing",
        "dangling": "is missing",
        "garbage": "is not a readable safetensors file",
        "truncated": "is not a readable safetensors file",
    }[kind]
    if kind == "fifo":
        [said] = _load_in_child(sharded)
        assert said.startswith("ConfigError: ") and message in said, said
        return
    with pytest.raises(ConfigError, match=message) as caught:
        _load(sharded)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_an_index_or_single_file_that_is_not_a_file(sharded, checkpoints, tmp_path, kind):
    single = tmp_path / "single"
    shutil.copytree(checkpoints["single"], single)
    paths = (sharded / INDEX, single / "model.safetensors")
    for path in paths:
        path.unlink()
        os.mkfifo(path) if kind == "fifo" else path.symlink_to("/dev/zero")
    if kind == "fifo":
        said = _load_in_child(*(p.parent for p in paths), *paths)
        assert len(said) == 4 and all(line.startswith("ConfigError: ") for line in said), said
        assert "is a FIFO" in said[0] and "is a FIFO" in said[1] and "not a file" in said[2] + said[3], said
        return
    for path in paths:
        with pytest.raises(ConfigError, match="is a device or socket, not a file"):
            _load(path.parent)
        with pytest.raises(ConfigError, match="is a device or socket, not a file"):
            _load(path)


def test_an_index_naming_a_tensor_its_file_lacks(sharded):
    index = _index(sharded)
    name, file = next(iter(index["weight_map"].items()))
    other = next(f for f in index["weight_map"].values() if f != file)
    _set(sharded, name, other)
    with pytest.raises(ConfigError, match=rf"has no readable tensor '{name}'"):
        _load(sharded)


def test_an_oversized_index_is_refused_unparsed(sharded, monkeypatch):
    monkeypatch.setattr(loading, "MAX_INDEX_BYTES", 100)
    with pytest.raises(ConfigError, match="a safetensors index is a small JSON file"):
        _load(sharded)


@pytest.mark.parametrize(
    "text", [b"{", b"[]", b"\xff", b'{"model_type": "llama", "hidden_size": "wide"}', b"[" * 100_000]
)
def test_a_malformed_config_is_one_config_error_when_the_model_is_built_from_it(sharded, text):
    (sharded / "config.json").write_bytes(text)
    with pytest.raises(ConfigError) as caught:
        load_checkpoint_and_dispatch(LlamaForCausalLM, sharded, {"": "cpu"}, print_summary=False)
    assert "\n" not in str(caught.value)
