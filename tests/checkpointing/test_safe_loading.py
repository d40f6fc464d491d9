"""Crafted checkpoint files run no code on resume: DCP metadata and values, DeepSpeed files, DeepSpeed's ``latest``."""

from __future__ import annotations

import json
import pathlib
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from tests.helpers.jobs import make_args
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.checkpointing import COMPLETE, CheckpointError, newest_complete, verify, write_marker
from trainer_ext.checkpointing import sharded as sharded_checkpoint
from trainer_ext.checkpointing.deepspeed_files import check_file as check_deepspeed_file
from trainer_ext.checkpointing.marker import seal
from trainer_ext.checkpointing.safe_dcp import UnsafeCheckpointError, load_metadata
from trainer_ext.errors import ConfigError

pytestmark = pytest.mark.timeout(120)


class Touch:
    """Unpickled in full, it creates ``path``: the stand-in for any code a crafted file could run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (self.path,)


def _sharded_checkpoint(folder: Path) -> None:
    """A committed checkpoint as FSDP writes it (model shards through DCP), from one process."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sharded_checkpoint.save_model(tiny_llama(0), folder)
    (folder / "trainer_state.json").write_text("{}")  # a Trainer checkpoint holds its state too
    write_marker(folder, world_size=1, step=int(folder.name.split("-")[1]))


def _trainer(out: Path) -> Trainer:
    return Trainer(model=tiny_llama(0), args=make_args(out, save_strategy="steps"), train_dataset=lm_dataset(4))


def test_crafted_dcp_metadata_is_refused_and_auto_resume_falls_back(tmp_path: Path, caplog) -> None:
    ran = tmp_path / "code_ran"
    for step in (2, 4):
        _sharded_checkpoint(tmp_path / f"checkpoint-{step}")
    newest = tmp_path / "checkpoint-4"
    (newest / "model_sharded" / ".metadata").write_bytes(pickle.dumps(Touch(ran)))
    write_marker(newest, world_size=1, step=4)  # committed as if saved so: sizes and checksums match

    with caplog.at_level("WARNING"):
        assert _trainer(tmp_path).resolve_resume("auto") == str(tmp_path / "checkpoint-2")
    assert "skipping checkpoint-4: model_sharded/.metadata cannot be read safely" in caplog.text
    assert "pathlib.Path.touch is not something checkpoint metadata holds" in caplog.text
    with pytest.raises(ConfigError, match=r"refusing to resume .*model_sharded/\.metadata cannot be read safely"):
        _trainer(tmp_path).resolve_resume(str(newest))
    with pytest.raises(UnsafeCheckpointError):  # loading directly, without the verification, refuses it too
        sharded_checkpoint.load_model(tiny_llama(0), newest)
    assert not ran.exists()


def test_a_crafted_value_in_sharded_optimizer_state_is_refused(tmp_path: Path) -> None:
    """Non-tensor values (optimizer hyper-parameters) are read weights_only, in verification and in loading."""
    ran = tmp_path / "code_ran"
    model = tiny_llama(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = get_optimizer_state_dict(model, optimizer)
    state["param_groups"][0]["lr"] = Touch(ran)
    folder = tmp_path / "checkpoint-2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder / sharded_checkpoint.OPTIMIZER_DIR), no_dist=True)
        sharded_checkpoint.save_model(model, folder)
    write_marker(folder, world_size=1, step=2)
    with pytest.raises(CheckpointError, match=r"param_groups\.0\.lr.*cannot be loaded safely \(weights_only=True\)"):
        verify(folder)
    with pytest.raises(UnsafeCheckpointError, match=r"param_groups\.0\.lr"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sharded_checkpoint.load_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), folder)
    assert not ran.exists()


def test_a_sharded_checkpoint_still_loads_whole(tmp_path: Path) -> None:
    """The allow-list holds what DCP writes: model and optimizer (tensors and hyper-parameters) round-trip."""
    model = tiny_llama(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(**{k: torch.tensor(v) for k, v in lm_dataset(2)[:2].items()}).loss.backward()
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sharded_checkpoint.save_model(model, tmp_path)
        sharded_checkpoint.save_optimizer(model, optimizer, tmp_path)
        clone = tiny_llama(1)
        again = torch.optim.AdamW(clone.parameters(), lr=5.0)
        sharded_checkpoint.load_model(clone, tmp_path)
        sharded_checkpoint.load_optimizer(clone, again, tmp_path)
    for a, b in zip(model.state_dict().values(), clone.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert again.param_groups[0]["lr"] == 1e-3
    assert torch.equal(again.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


def _deepspeed_layout(folder: Path, optimizer_state: object) -> Path:
    """The files of a DeepSpeed checkpoint (``latest`` + ``global_step2/``), the optimizer file holding ``state``."""
    tag = folder / "global_step2"
    tag.mkdir(parents=True)
    (folder / "latest").write_text("global_step2")
    torch.save(
        {"module": {"w": torch.zeros(2)}, "param_shapes": [{"w": torch.Size([2])}]}, tag / "mp_rank_00_model_states.pt"
    )
    torch.save(optimizer_state, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def test_a_deepspeed_file_holding_more_than_deepspeed_saves_is_refused(tmp_path: Path) -> None:
    """DeepSpeed unpickles its files in full: they are first loaded weights_only with DeepSpeed's own classes."""
    ran = tmp_path / "code_ran"
    crafted = _deepspeed_layout(tmp_path / "checkpoint-2", {"optimizer_state_dict": {"loss_scaler": Touch(ran)}})
    with pytest.raises(CheckpointError, match="holds more than DeepSpeed saves"):
        check_deepspeed_file(crafted)
    write_marker(tmp_path / "checkpoint-2", world_size=1, step=2)
    with pytest.raises(CheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt holds more than"):
        verify(tmp_path / "checkpoint-2")
    assert not ran.exists()


def test_deepspeed_latest_must_name_a_folder_beside_it(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint-2"
    _deepspeed_layout(folder, {"optimizer_state_dict": {"step": 1}})
    write_marker(folder, world_size=1, step=2)
    verify(folder)
    shutil.copytree(folder, tmp_path / "elsewhere")
    (folder / "latest").write_text("../elsewhere/global_step2")
    (folder / COMPLETE).unlink()
    with pytest.raises(CheckpointError, match="latest names '../elsewhere/global_step2'"):
        verify(folder, require_marker=False)


def test_a_padded_latest_is_still_checked(tmp_path: Path) -> None:
    """DeepSpeed strips ``latest``: padding it must not skip the check (a long one is refused outright)."""
    folder = tmp_path / "checkpoint-2"
    _deepspeed_layout(folder, {"optimizer_state_dict": {"step": 1}})
    shutil.copytree(folder, tmp_path / "elsewhere")
    (folder / "latest").write_text("../elsewhere/global_step2" + " " * 1100)
    write_marker(folder, world_size=1, step=2)
    with pytest.raises(CheckpointError, match=r"latest has 1125 bytes, more than a DeepSpeed tag name"):
        verify(folder)
    (folder / "latest").write_text("../elsewhere/global_step2" + " " * 200)
    write_marker(folder, world_size=1, step=2)
    with pytest.raises(CheckpointError, match="latest names '../elsewhere/global_step2'"):
        verify(folder)


def test_a_linked_tag_folder_is_refused(tmp_path: Path) -> None:
    """A tag folder that links elsewhere: its files would be loaded by DeepSpeed but never checked."""
    ran = tmp_path / "code_ran"
    folder = tmp_path / "checkpoint-2"
    _deepspeed_layout(folder, {"optimizer_state_dict": {"step": 1}})
    crafted = _deepspeed_layout(tmp_path / "elsewhere", {"optimizer_state_dict": {"loss_scaler": Touch(ran)}})
    (folder / "global_step3").symlink_to(crafted.parent, target_is_directory=True)
    (folder / "latest").write_text("global_step3")
    write_marker(folder, world_size=1, step=2)
    with pytest.raises(CheckpointError, match=r"global_step3 is a symbolic link"):
        verify(folder)
    (folder / COMPLETE).unlink()
    with pytest.raises(CheckpointError, match=r"global_step3 is a symbolic link"):
        verify(folder, require_marker=False)
    assert not ran.exists()


@pytest.mark.parametrize("name", ["/dev/zero", "../outside.bin", "/etc/hostname"])
def test_a_marker_cannot_point_its_checksums_outside(tmp_path: Path, name: str) -> None:
    """Checksum names come from the marker: only its own listed files are read (``/dev/zero`` would never end)."""
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    (folder / "state.json").write_text("{}")
    (tmp_path / "outside.bin").write_bytes(b"x" * 10)
    write_marker(folder, world_size=1, step=2)
    body = json.loads((folder / COMPLETE).read_text())
    body["crc32"][name] = 0
    (folder / COMPLETE).write_text(json.dumps(seal(body)))  # re-sealed: a crafted marker, not a damaged one
    with pytest.raises(CheckpointError, match=r"crc32 does not cover exactly the listed files"):
        verify(folder)
    body["files"][name] = 10
    (folder / COMPLETE).write_text(json.dumps(seal(body)))
    with pytest.raises(CheckpointError, match=r"which is not a file inside the checkpoint"):
        verify(folder)


def test_a_dcp_tensor_path_pointing_outside_is_refused(tmp_path: Path) -> None:
    """Tensor entries of DCP metadata may not name files outside their folder (verification and loading)."""
    folder = tmp_path / "checkpoint-2"
    _sharded_checkpoint(folder)
    shutil.copytree(folder, tmp_path / "elsewhere")
    metadata_file = folder / "model_sharded" / ".metadata"
    metadata = load_metadata(metadata_file)
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere/model_sharded/" + info.relative_path
    metadata_file.write_bytes(pickle.dumps(metadata))
    write_marker(folder, world_size=1, step=2)
    with pytest.raises(CheckpointError, match=r"model_sharded/\.metadata points outside its folder"):
        verify(folder)
    with pytest.raises(UnsafeCheckpointError, match="points outside its folder"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sharded_checkpoint.load_model(tiny_llama(0), folder)


def test_malformed_files_make_resume_fall_back_instead_of_crashing(tmp_path: Path) -> None:
    """Headers and metadata of unexpected shapes are problems of the checkpoint, never crashes of the resume."""
    _sharded_checkpoint(tmp_path / "checkpoint-2")
    weird = tmp_path / "checkpoint-4"
    weird.mkdir()
    header = json.dumps({"a": 1}).encode()
    (weird / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    write_marker(weird, world_size=1, step=4)
    odd = tmp_path / "checkpoint-6"
    _sharded_checkpoint(odd)
    metadata = load_metadata(odd / "model_sharded" / ".metadata")
    fqn = next(iter(metadata.state_dict_metadata))
    metadata.state_dict_metadata[fqn] = torch.distributed.checkpoint.metadata.BytesStorageMetadata()
    for index, info in metadata.storage_data.items():
        if index.fqn == fqn:
            info.offset = "start"  # DCP's classes, a value of the wrong type
    (odd / "model_sharded" / ".metadata").write_bytes(pickle.dumps(metadata))
    write_marker(odd, world_size=1, step=6)
    nested = tmp_path / "checkpoint-8"
    nested.mkdir()
    (nested / "trainer_state.json").write_text("[" * 100_000 + "]" * 100_000)
    write_marker(nested, world_size=1, step=8)

    chosen, skipped = newest_complete(tmp_path)
    assert chosen == tmp_path / "checkpoint-2"
    assert skipped[0].startswith("checkpoint-8: cannot be checked (RecursionError"), skipped
    assert skipped[1].startswith("checkpoint-6: model_sharded/.metadata is malformed (TypeError"), skipped
    assert skipped[2].startswith("checkpoint-4: model.safetensors has a malformed header"), skipped
