"""The output-directory guard: never train over another job's run, never resume by accident, delete only on request.

A job writes ``trainer_ext_run.json`` (the fingerprint of its model, data and task) when it starts. A later
job in the same directory must have the same fingerprint; with checkpoints present it must also say whether
to resume (``--resume_from_checkpoint``) or start over (``--overwrite_output_dir``). The data shipped with the
package is recorded by name (``<built-in sentiment.jsonl>``), not by where the package is installed.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any

from trainer_ext.checkpointing import disk_space
from trainer_ext.checkpointing.links import links_under, open_no_follow, refuse_link, remove_entry
from trainer_ext.checkpointing.listing import sorted_checkpoints
from trainer_ext.checkpointing.selection import newest_complete, requested_checkpoint
from trainer_ext.errors import ConfigError
from trainer_ext.job import run_lock
from trainer_ext.job.arguments import TrainJobArguments
from trainer_ext.job.builtin_data import CORPUS, SENTIMENT

RUN_FILE = "trainer_ext_run.json"
RUN_FILE_TMP = f".{RUN_FILE}.tmp"
_CHECKPOINT = re.compile(r"checkpoint-\d+")
# What a finished run leaves in output_dir besides checkpoints; removed by --overwrite_output_dir.
RUN_ARTIFACTS = (
    RUN_FILE,
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "training_args.bin",
    "trainer_state.json",
    "train_results.json",
    "eval_results.json",
    "all_results.json",
    "adapter_model.safetensors",  # a LoRA run's (trainer-ext train --lora_r)
    "adapter_config.json",
    "trainer_ext_events.jsonl",  # the run's event log (report.events), read by trainer-ext report
)
RUN_FOLDERS = ("merged", "report")  # --merge_lora's export; the run report (--report_plots)
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "config.json")


SHIPPED_FILES = (SENTIMENT, CORPUS)
DATA_KEYS = ("train_file", "validation_file")
# where an install keeps the shipped data, and where it kept it before the data moved under job/
SHIPPED_AT = (("trainer_ext", "job", "builtin_data"), ("trainer_ext", "data"))


def shipped_name(path: Any) -> str | None:
    """``<built-in NAME>`` when ``path`` is a data file shipped with the package, wherever it is installed (this
    install's file, or a path recorded by another: ``.../trainer_ext/job/builtin_data/NAME``); else None."""
    if not isinstance(path, str) or not path:
        return None
    for shipped in SHIPPED_FILES:
        parts = Path(path).parts
        located = any(parts[-len(at) - 1 :] == (*at, shipped.name) for at in SHIPPED_AT)
        if located or _same_file(path, shipped):
            return f"<built-in {shipped.name}>"
    return None


def _same_file(path: str, shipped: Path) -> bool:
    try:
        return os.path.samefile(path, shipped)
    except OSError:
        return False


def portable(job: dict[str, Any] | None) -> dict[str, Any] | None:
    """A job fingerprint with the shipped data named instead of located, so installs in other places agree."""
    if not isinstance(job, dict):
        return job
    return {k: (shipped_name(v) or v) if k in DATA_KEYS else v for k, v in job.items()}


def job_identity(args: TrainJobArguments) -> dict[str, Any]:
    """What identifies ``args``'s job in ``trainer_ext_run.json``: its fingerprint, made :func:`portable`."""
    return portable(args.fingerprint())


def read_fingerprint(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The job fingerprint a previous run left in ``directory``, or None."""
    path = Path(directory) / RUN_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("job")
    except (OSError, ValueError, AttributeError):
        return None


def resume_target(args: TrainJobArguments) -> bool | str | None:
    """``--resume_from_checkpoint`` as Trainer.train wants it: None, True (newest complete), "auto" or a path.

    "auto" resumes from the newest complete checkpoint when there is one and starts fresh otherwise: the
    same command works for the first start and for every restart or requeue.
    """
    return requested_checkpoint(args.resume_from_checkpoint, flag="--resume_from_checkpoint")


def check(args: TrainJobArguments) -> bool | str | None:
    """Refuse an output_dir holding another job's run or unrequested checkpoints; return the resume target.

    Reads only; runs on every rank before anything is written, so all ranks agree.
    """
    out = Path(args.output_dir)
    resume = resume_target(args)
    if _exists(out) and not out.is_dir():
        raise ConfigError(f"--output_dir {str(out)!r} is a file; pass a directory")
    _check_writable(out)
    check_links(out, args.overwrite_output_dir)
    found = sorted_checkpoints(out)
    if resume is not None and args.overwrite_output_dir:
        raise ConfigError(
            "--overwrite_output_dir deletes the checkpoints that --resume_from_checkpoint would resume from; "
            "pass one of the two"
        )
    if resume is True:
        if not found:
            raise ConfigError(
                f"--resume_from_checkpoint: no checkpoint in {str(out)!r} to resume from. Drop the flag "
                "to start a new run, or pass the path of a checkpoint folder"
            )
    holds_run = bool(found) or any((out / name).exists() for name in MODEL_FILES + (RUN_FILE,))
    if not holds_run or args.overwrite_output_dir:
        return resume
    previous = portable(read_fingerprint(out))
    if previous != job_identity(args):
        raise ConfigError(
            f"--output_dir {str(out)!r} already holds a run of a different job ({_difference(previous, args)}). "
            "Pick another --output_dir, or pass --overwrite_output_dir to replace that run"
        )
    if found and resume is None:
        latest, _ = newest_complete(out, verify=False)  # named only: resume verifies what it picks
        raise ConfigError(
            f"--output_dir {str(out)!r} holds checkpoints of this job (latest: {latest.name}). Pass "
            "--resume_from_checkpoint true (or auto) to continue from the newest complete one, or "
            "--overwrite_output_dir to start over"
        )
    return resume


def _exists(out: Path) -> bool:
    """Whether ``out`` exists; ConfigError in one line when the path cannot even be looked up (too long ...)."""
    try:
        os.lstat(out)
    except FileNotFoundError:
        return False
    except OSError as error:
        too_long = error.errno == errno.ENAMETOOLONG
        reason = "a name in it is too long for the file system" if too_long else error.strerror
        shown = str(out) if len(str(out)) <= 120 else str(out)[:120] + "..."
        fix = "pick a shorter path" if too_long else "pick another directory"
        raise ConfigError(f"--output_dir {shown!r} cannot be used ({reason}); {fix}") from None
    return True


def written_links(out: Path, overwrite: bool = False) -> list[Path]:
    """The links in ``out`` where a job writes: checkpoint folders, the run's files and folders and what is inside
    them, the lock; with ``overwrite`` only those --overwrite_output_dir does not remove (the lock, the tmp)."""
    if not out.is_dir():
        return []
    kept = [out / run_lock.LOCK_FILE, out / RUN_FILE_TMP]
    removed = [out / name for name in RUN_ARTIFACTS + RUN_FOLDERS]
    checkpoints = checkpoint_entries(out)
    found = [p for p in kept + ([] if overwrite else removed + checkpoints) if p.is_symlink()]
    if not overwrite:
        folders = checkpoints + [out / name for name in RUN_FOLDERS]
        found += [link for p in folders if not p.is_symlink() for link in links_under(p)]
    return found


def checkpoint_entries(out: Path) -> list[Path]:
    """Every ``checkpoint-N`` entry of ``out``: folders, and links of any kind (to a folder, a file, nowhere)."""
    found = sorted_checkpoints(out)
    links = [p for p in out.iterdir() if _CHECKPOINT.fullmatch(p.name) and p.is_symlink() and p not in found]
    return found + sorted(links)


def check_links(out: Path, overwrite: bool = False) -> None:
    """The link rule at start-up: refuse (one line naming it) a link where the job would write (:func:`written_links`)."""
    for link in written_links(out, overwrite):
        refuse_link(link, "where this job writes")


def _check_writable(out: Path) -> None:
    """Fail now, not at the first checkpoint: probe the output dir (or the folder that will hold it)."""
    import tempfile

    probe_dir = out
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    try:
        with tempfile.NamedTemporaryFile(dir=probe_dir, prefix=".trainer_ext_write_probe"):
            pass
    except OSError as error:
        raise ConfigError(
            f"cannot write to --output_dir {str(out)!r} ({error.strerror or error}); pick a writable directory"
        ) from error


def _difference(previous: dict[str, Any] | None, args: TrainJobArguments) -> str:
    """A short account of how the previous run's job differs from this one."""
    if previous is None:
        return f"no {RUN_FILE}: not written by trainer-ext train"
    current = job_identity(args)
    changed = [f"{k}: {previous.get(k)!r} -> {current[k]!r}" for k in current if previous.get(k) != current[k]]
    return "; ".join(changed[:3]) or "different fingerprint"


def start_run(args: TrainJobArguments, trainer: Any) -> None:
    """On the main process: lock the folder for this process (:mod:`run_lock`), clear a replaced run
    (--overwrite_output_dir) and write this job's fingerprint."""
    with args.main_process_first(local=False, desc="preparing output_dir"):
        if not trainer.is_world_process_zero():
            return
        out = Path(args.output_dir)
        check_links(out, args.overwrite_output_dir)  # again: a link may have been made since check()
        run_lock.acquire(out)  # before anything is deleted or written: another run may be writing here
        if args.overwrite_output_dir and out.is_dir():
            doomed = checkpoint_entries(out) + [out / name for name in RUN_ARTIFACTS + RUN_FOLDERS]
            for path in doomed:  # decided first; a link is removed itself, never what it points to
                remove_entry(path)
        tmp = out / RUN_FILE_TMP
        text = json.dumps({"trainer_ext_run": 1, "job": job_identity(args)}, indent=2) + "\n"
        try:
            refuse_link(tmp, "the run file's temporary copy")
            tmp.unlink(missing_ok=True)  # a leftover of a killed start: created afresh, never written through
            with open(open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w", encoding="utf-8") as handle:
                handle.write(text)
            os.replace(tmp, out / RUN_FILE)  # a rename: a link named RUN_FILE is replaced, not followed
        except OSError as error:
            if not tmp.is_symlink():
                tmp.unlink(missing_ok=True)
            if disk_space.is_disk_full(error):
                raise disk_space.save_failed(out / RUN_FILE, error, None, None) from None
            raise


def check_space(args: TrainJobArguments, trainer: Any) -> None:
    """Refuse to start, before anything is written, when output_dir cannot hold the final model and, if the job
    saves checkpoints, one checkpoint (rotation frees older ones only after the next is complete)."""
    if not trainer.is_world_process_zero() or trainer.model is None:
        return
    model = trainer.accelerator.unwrap_model(trainer.model)
    needed = disk_space.checkpoint_bytes(model, optimizer_states=0)  # the final model
    what = "the model"
    if str(getattr(args.save_strategy, "value", args.save_strategy)) != "no":
        needed += disk_space.checkpoint_bytes(model)
        what = "the final model and a checkpoint"
    disk_space.check_room(args.output_dir, needed, what)
