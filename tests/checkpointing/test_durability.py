"""A checkpoint's data is durable before its marker: fsync errors stop the commit, each rank syncs its own files."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from trainer_ext.checkpointing.durable import flush_tree, writer_rank

pytestmark = pytest.mark.timeout(60)


def _tree(folder: Path) -> None:
    """Files as a 2-rank save leaves them: shared ones, and per-rank ones in sub-folders."""
    for name in (
        "model.safetensors",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "rng_state_1.pth",
        "model_sharded/.metadata",
        "model_sharded/__0_0.distcp",
        "model_sharded/__1_0.distcp",
        "global_step2/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"data")


def _record(monkeypatch: pytest.MonkeyPatch, fail: int | None = None) -> set[str]:
    """The paths os.fsync is called on from now on (failing with ``fail`` when given)."""
    synced: set[str] = set()
    real = os.fsync

    def record(fd: int) -> None:
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))
        if fail is not None:
            raise OSError(fail, os.strerror(fail))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return synced


def test_deepspeed_bf16_partitions_carry_their_rank() -> None:
    assert writer_rank("global_step2/bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt") == 3
    assert writer_rank("global_step2/zero_pp_rank_2_mp_rank_00_optim_states.pt") == 2
    assert writer_rank("global_step2/mp_rank_00_model_states.pt") is None


def test_each_rank_fsyncs_its_own_files_and_every_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path)
    synced = _record(monkeypatch)
    flush_tree(tmp_path, rank=1, main=False)
    root = tmp_path.resolve()
    folders = {str(root), str(root / "model_sharded"), str(root / "global_step2")}
    mine = {"random_states_1.pkl", "rng_state_1.pth", "model_sharded/__1_0.distcp"}
    mine.add("global_step2/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert synced == folders | {str(root / name) for name in mine}
    synced.clear()
    flush_tree(tmp_path, rank=0, main=True)
    shared = {"model.safetensors", "random_states_0.pkl", "model_sharded/.metadata", "model_sharded/__0_0.distcp"}
    assert synced == folders | {str(root / name) for name in shared}


def test_an_fsync_error_stops_the_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO or ENOSPC from fsync means the data may not be on disk: never go on to write the marker."""
    _tree(tmp_path)
    _record(monkeypatch, fail=errno.EIO)
    with pytest.raises(OSError, match=r"cannot make .* durable \(fsync failed: Input/output error\).*save again"):
        flush_tree(tmp_path, rank=0, main=True)


def test_fsync_unsupported_by_the_file_system_is_no_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path)
    synced = _record(monkeypatch, fail=errno.EINVAL)
    flush_tree(tmp_path, rank=0, main=True)
    assert synced
