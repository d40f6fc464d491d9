"""The corruption matrix: every file kind of a checkpoint crossed with every damage (test_corruption_matrix.py).

A case copies ``checkpoint-2`` and ``checkpoint-4`` of a real run into a fresh output folder, damages one file of
``checkpoint-4``, then asks a Trainer for the resume: ``resolve_resume(True)`` must fall back to ``checkpoint-2``
(the skip logged) and ``resolve_resume(path)`` must refuse ``checkpoint-4`` with a ConfigError naming the file.

``python -m tests.checkpointing.corruption_jobs OUT fsdp|deepspeed`` (under torchrun, 2 ranks): trains to step 4
with FSDP2 (sharded state dict) or DeepSpeed ZeRO-3 into ``OUT/run``, then runs that strategy's cases on both
ranks; each rank writes ``rank<R>.json``. ``python -m tests.checkpointing.corruption_jobs --table`` runs the whole
matrix (one process, then both 2-rank runs) and prints it as a Markdown table.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.checkpointing.fault_jobs import Lines
from tests.helpers.jobs import make_args
from tests.helpers.paths import CONFIGS
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.errors import ConfigError

JOB = "tests.checkpointing.corruption_jobs"
PREVIOUS, DAMAGED = "checkpoint-2", "checkpoint-4"
STRATEGIES: dict[str, dict[str, Any]] = {
    "single": {"per_device_train_batch_size": 2},
    "fsdp": {"fsdp": True, "per_device_train_batch_size": 1},
    "deepspeed": {"deepspeed": str(CONFIGS / "deepspeed" / "zero3.json"), "per_device_train_batch_size": 1},
}


def _truncate(path: Path, outside: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path, outside: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _empty(path: Path, outside: Path) -> None:
    path.write_bytes(b"")


def _delete(path: Path, outside: Path) -> None:
    path.unlink()


def _symlink(path: Path, outside: Path) -> None:
    """The same bytes, but through a link to a copy outside the checkpoint: sizes and checksums still match."""
    copy = outside / f"{path.parent.name}_{path.name}"
    shutil.copyfile(path, copy)
    path.unlink()
    path.symlink_to(copy)


def _link_folder(path: Path, outside: Path) -> None:
    """The folder moved outside the checkpoint and a link left in its place: every file as committed, reached
    through the link (``.``: the checkpoint folder itself)."""
    moved = outside / path.name
    shutil.move(path, moved)
    path.symlink_to(moved, target_is_directory=True)


def _json(text: str) -> Callable[[Path, Path], None]:
    def write(path: Path, outside: Path) -> None:
        path.write_text(text)

    return write


DAMAGES: dict[str, Callable[[Path, Path], None]] = {
    "truncate": _truncate,
    "flip": _flip,
    "empty": _empty,
    "delete": _delete,
    "symlink": _symlink,
}
JSON_DAMAGES: dict[str, Callable[[Path, Path], None]] = {"json []": _json("[]"), "json 1": _json("1")}
FOLDER_DAMAGES: dict[str, Callable[[Path, Path], None]] = {"folder symlink": _link_folder}
# the folders of a checkpoint (``.``: checkpoint-4 itself) that get FOLDER_DAMAGES instead of the files' damages
FOLDERS = (".", "model_sharded", "optimizer_sharded", "global_step4")

# (kind, file inside checkpoint-N) for each strategy; the damages a file gets depend on whether it is JSON
FILES: dict[str, list[tuple[str, str]]] = {
    "single": [
        ("checkpoint folder", "."),
        ("marker", "COMPLETE"),
        ("weights", "model.safetensors"),
        ("optimizer", "optimizer.pt"),
        ("scheduler", "scheduler.pt"),
        ("RNG", "rng_state.pth"),
        ("trainer state", "trainer_state.json"),
    ],
    "fsdp": [
        ("DCP folder", "model_sharded"),
        ("DCP folder", "optimizer_sharded"),
        ("DCP shard", "model_sharded/__1_0.distcp"),
        ("DCP metadata", "model_sharded/.metadata"),
        ("DCP shard", "optimizer_sharded/__0_0.distcp"),
        ("DCP metadata", "optimizer_sharded/.metadata"),
        ("RNG (per rank)", "rng_state_1.pth"),
    ],
    "deepspeed": [
        ("DeepSpeed tag folder", "global_step4"),
        ("DeepSpeed shard", "global_step4/zero_pp_rank_1_mp_rank_00_model_states.pt"),
        ("DeepSpeed shard", "global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        ("DeepSpeed latest", "latest"),
    ],
}


def damages_for(name: str) -> dict[str, Callable[[Path, Path], None]]:
    if name in FOLDERS:
        return FOLDER_DAMAGES
    return {**DAMAGES, **JSON_DAMAGES} if name == "COMPLETE" or name.endswith(".json") else DAMAGES


def cases(strategy: str) -> list[tuple[str, str, str]]:
    """(kind, file, damage) of a strategy's matrix, the undamaged control first."""
    found = [("control", "-", "intact")]
    for kind, name in FILES[strategy]:
        found += [(kind, name, how) for how in damages_for(name)]
    return found


def case_id(name: str, how: str) -> str:
    return f"{name}:{how}".replace("/", "-").replace(" ", "_")


def trainer(out: Path, strategy: str, **overrides: Any) -> Trainer:
    settings = {"save_strategy": "steps", "save_steps": 2, "max_steps": 4, **STRATEGIES[strategy], **overrides}
    return Trainer(model=tiny_llama(0), args=make_args(out, **settings), train_dataset=lm_dataset(16, seed=3))


def train(out: Path, strategy: str) -> Path:
    """A real run that saves checkpoint-2 and checkpoint-4 into ``out``."""
    trainer(out, strategy).train()
    return out


def prepare(run: Path, out: Path, name: str, how: str) -> None:
    """``out`` := copies of the run's two checkpoints, ``name`` of the newest damaged by ``how`` (one process)."""
    out.mkdir(parents=True)
    for checkpoint in (PREVIOUS, DAMAGED):
        shutil.copytree(run / checkpoint, out / checkpoint, symlinks=True)
    if how != "intact":
        outside = out / "outside"
        outside.mkdir()
        damages_for(name)[how](out / DAMAGED / name, outside)


def _ask(make: Callable[[], Trainer], value: Any) -> tuple[str | None, str | None, list[str]]:
    handler = Lines()
    logger = logging.getLogger("trainer_ext.trainer.checkpoints")
    logger.addHandler(handler)
    try:
        chosen = make().resolve_resume(value)
        return (chosen and Path(chosen).name), None, handler.lines
    except ConfigError as error:
        return None, str(error), handler.lines
    finally:
        logger.removeHandler(handler)


def outcome(make: Callable[[], Trainer], out: Path) -> dict[str, Any]:
    """What resume does with ``out``: auto-resume's choice and skip lines, and the explicit path's answer."""
    auto, auto_error, lines = _ask(make, True)
    path, refused, _ = _ask(make, str(out / DAMAGED))
    return {
        "auto": auto,
        "auto_error": auto_error,
        "skipped": [line for line in lines if line.startswith("resume: skipping")],
        "path": path,
        "refused": refused,
    }


def multi_rank(out: Path, strategy: str) -> dict[str, dict[str, Any]]:
    """Train on every rank, then every case of ``strategy``: rank 0 prepares it, all ranks resolve it."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    run = train(out / "run", strategy)
    results = {}
    for _, name, how in cases(strategy):
        folder = out / "cases" / case_id(name, how)
        if rank == 0:
            prepare(run, folder, name, how)
        dist.barrier()
        results[case_id(name, how)] = outcome(lambda folder=folder: trainer(folder, strategy), folder)
    return results


def single_matrix(work: Path) -> dict[str, dict[str, Any]]:
    """The one-process matrix, in this process."""
    run = train(work / "run", "single")
    results = {}
    for _, name, how in cases("single"):
        folder = work / "cases" / case_id(name, how)
        prepare(run, folder, name, how)
        results[case_id(name, how)] = outcome(lambda folder=folder: trainer(folder, "single"), folder)
    return results


def _start(text: str | None, words: int = 14) -> str:
    if text is None:
        return ""
    parts = " ".join(text.split()).split(" ")
    return " ".join(parts[:words]) + (" …" if len(parts) > words else "")


def cell_auto(result: dict[str, Any]) -> str:
    if result["auto"] == PREVIOUS and result["skipped"]:
        reason = result["skipped"][0].removeprefix(f"resume: skipping {DAMAGED}: ")
        return f"falls back: {_start(reason)}"
    if result["auto_error"]:
        return f"refused: {_start(result['auto_error'])}"
    return f"**resumes {result['auto']}**"


def cell_path(result: dict[str, Any]) -> str:
    if result["refused"]:
        text = result["refused"]
        head, _, rest = text.partition(": ")
        return f"refused: {_start(rest if head.startswith('refusing to resume from') else text)}"
    return f"**resumes {result['path']}**"


def table(rows: list[tuple[str, str, str, dict[str, Any]]]) -> str:
    lines = [
        "| file kind | file | damage | `resume_from_checkpoint=True` | `resume_from_checkpoint=<checkpoint-4>` |",
        "|---|---|---|---|---|",
    ]
    for setting, (kind, name, how, result) in rows:
        lines.append(f"| {kind} ({setting}) | `{name}` | {how} | {cell_auto(result)} | {cell_path(result)} |")
    return "\n".join(lines)


def print_table() -> None:
    """Run the whole matrix and print it (by hand: ``python -m tests.checkpointing.corruption_jobs --table``)."""
    from tests.helpers.ranks import run_ranks

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        single = single_matrix(work / "single")
        rows += [("1 process", (k, n, h, single[case_id(n, h)])) for k, n, h in cases("single")]
        for strategy, setting in (("fsdp", "FSDP2, 2 ranks"), ("deepspeed", "ZeRO-3, 2 ranks")):
            out = work / strategy
            run_ranks(JOB, 2, str(out), strategy, timeout=360)
            first = json.loads((out / "rank0.json").read_text())  # rank 0's: only it logs the skipped ones
            rows += [(setting, (k, n, h, first[case_id(n, h)])) for k, n, h in cases(strategy)]
    print(table(rows))


def main(out: str, strategy: str) -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    results = multi_rank(Path(out), strategy)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()


if __name__ == "__main__":
    if sys.argv[1:] == ["--table"]:
        print_table()
    else:
        main(*sys.argv[1:3])
