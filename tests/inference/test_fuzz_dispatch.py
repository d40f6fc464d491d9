"""Property-based fuzzing of checkpoint folders for ``load_checkpoint_and_dispatch``: random index documents
(random JSON, deep nesting, raw bytes, weight maps naming real shards, paths out of the folder, pickles, non-strings)
and damaged shard bytes.

Every folder ends with the model loaded (equal to the saved one when the shards are intact) or one ConfigError line,
never another exception. Bounded for CI: ``EXAMPLES`` examples per property
(``TRAINER_EXT_FUZZ_EXAMPLES`` overrides), no deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

hypothesis = pytest.importorskip("hypothesis", reason="the dev extra installs hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.inference.dispatch_models import llama_config, prompt  # noqa: E402
from trainer_ext.errors import ConfigError  # noqa: E402
from trainer_ext.inference import init_empty_weights, load_checkpoint_and_dispatch  # noqa: E402

EXAMPLES = int(os.environ.get("TRAINER_EXT_FUZZ_EXAMPLES", "60"))
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)
INDEX = "model.safetensors.index.json"

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def file_names(shards: list[str]) -> st.SearchStrategy[object]:
    """What an index may name for a tensor: its real shard, another shard, or something hostile."""
    return st.one_of(
        st.sampled_from(shards),
        st.sampled_from(shards).map(lambda s: f"../sharded/{s}"),
        st.sampled_from(shards).map(lambda s: f"./{s}"),
        st.sampled_from(["/etc/passwd", "/dev/zero", "", ".", "..", "pytorch_model.bin", "nothing.safetensors"]),
        st.sampled_from(["sub/../x.safetensors", "a\\..\\b.safetensors", "x\x00.safetensors", "~/x.safetensors"]),
        scalars,
        json_values,
    )


@pytest.fixture(scope="module")
def saved(checkpoints) -> dict[str, object]:
    """The sharded checkpoint's index, shard names and the reference logits."""
    folder = Path(checkpoints["sharded"])
    index = json.loads((folder / INDEX).read_text())
    with torch.no_grad():
        logits = checkpoints["model"](prompt()).logits
    return {"folder": folder, "index": index, "shards": sorted(set(index["weight_map"].values())), "logits": logits}


def _attempt(folder: Path, reference: torch.Tensor) -> None:
    """Load ``folder``: the saved model, or one ConfigError line."""
    with init_empty_weights():
        model = LlamaForCausalLM(llama_config())
    try:
        loaded = load_checkpoint_and_dispatch(model, folder, {"": "cpu"}, print_summary=False)
    except ConfigError as error:
        assert str(error) and "\n" not in str(error), str(error)
        return
    with torch.no_grad():
        assert torch.equal(loaded(prompt()).logits, reference)


def _copy(saved: dict[str, object], root: str) -> Path:
    folder = Path(root) / "sharded"
    shutil.copytree(saved["folder"], folder)
    return folder


@SETTINGS
@given(data=st.data())
def test_any_index_document(saved, data):
    shards = saved["shards"]
    names = list(saved["index"]["weight_map"])
    weight_map = st.dictionaries(
        st.sampled_from(names) | st.text(max_size=8), file_names(shards), min_size=0, max_size=len(names)
    )
    # mostly the real map with a few entries changed, so that the loader gets past the first check
    edits = st.dictionaries(st.sampled_from(names), file_names(shards), max_size=3).map(
        lambda e: {**saved["index"]["weight_map"], **e}
    )
    document = data.draw(
        st.one_of(
            edits.map(lambda m: json.dumps({"metadata": {}, "weight_map": m}).encode()),
            weight_map.map(lambda m: json.dumps({"weight_map": m}).encode()),
            json_values.map(lambda v: json.dumps(v).encode()),
            st.integers(50, 5000).map(lambda n: b"[" * n + b"]" * n),
            st.binary(max_size=40),
        )
    )
    with tempfile.TemporaryDirectory() as root:
        folder = _copy(saved, root)
        (folder / INDEX).write_bytes(document)
        _attempt(folder, saved["logits"])


@SETTINGS
@given(data=st.data())
def test_damaged_shard_bytes(saved, data):
    shard = data.draw(st.sampled_from(saved["shards"]))
    with tempfile.TemporaryDirectory() as root:
        folder = _copy(saved, root)
        raw = bytearray((folder / shard).read_bytes())
        kind = data.draw(st.sampled_from(["cut", "flip", "header", "replace"]))
        if kind == "cut":
            raw = raw[: data.draw(st.integers(0, len(raw)))]
        elif kind == "flip":
            at = data.draw(st.integers(0, min(len(raw) - 1, 4096)))
            raw[at] ^= data.draw(st.integers(1, 255))
        elif kind == "header":
            raw[:8] = data.draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
        else:
            raw = bytearray(data.draw(st.binary(max_size=64)))
        (folder / shard).write_bytes(bytes(raw))
        _attempt_damaged(folder)


def _attempt_damaged(folder: Path) -> None:
    """As ``_attempt``, but a flipped byte inside a tensor's data may load (with other values): that is fine."""
    with init_empty_weights():
        model = LlamaForCausalLM(llama_config())
    try:
        load_checkpoint_and_dispatch(model, folder, {"": "cpu"}, print_summary=False)
    except ConfigError as error:
        assert str(error) and "\n" not in str(error), str(error)
