"""``trainer-ext estimate``: per-rank memory of a training job before it runs, and (``--measure``) after two steps.

Takes every ``trainer-ext train`` flag (model, data, batch, precision, ``--fsdp``/``--deepspeed``) plus
``--num_processes``, ``--device_memory``, ``--measure`` and ``--json FILE``. See docs/estimate.md.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from trainer_ext.errors import ConfigError
from trainer_ext.values import format_size

WORKER = "trainer_ext.estimate.worker"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise ConfigError(f"estimate: {message.removeprefix('argument ')}")


MAX_PROCESSES = 1 << 20  # far beyond any real job (the launcher's bound): a typo or 10**29 is refused up front


def _process_count(text: str) -> int:
    valid = f"a whole number between 1 and {MAX_PROCESSES}"
    try:
        number = int(text)
    except ValueError:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise argparse.ArgumentTypeError(f"needs {valid}, got {shown!r}") from None
    if not 1 <= number <= MAX_PROCESSES:
        raise argparse.ArgumentTypeError(f"{number} must be between 1 and {MAX_PROCESSES}")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trainer-ext estimate",
        add_help=False,
        allow_abbrev=False,
        description="Estimate per-rank memory of `trainer-ext train` with the same flags; every train flag is "
        "accepted (trainer-ext train --help).",
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    parser.add_argument(
        "--num_processes",
        type=_process_count,
        default=None,
        help="processes (ranks) to estimate for (default: the product of --dp_replicate_size, --dp_shard_size and "
        "--tp_size, else 1)",
    )
    parser.add_argument(
        "--device_memory",
        metavar="SIZE",
        help="memory of one device, e.g. 80GiB or 24GB: prints the largest "
        "micro-batch that fits and the flags that make the job fit",
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="also run two real optimizer steps on this machine and print what each rank held beside the estimate",
    )
    parser.add_argument("--json", metavar="FILE", help='write {"estimated": {...}, "measured": {...}} in bytes')
    return parser


def measure(train_argv: Sequence[str], num_processes: int, timeout: float | None = None) -> dict[str, Any]:
    """Run the job for two optimizer steps on ``num_processes`` local ranks; the largest value of each key."""
    from trainer_ext.estimate.worker import launch_ranks, output_tail

    out_dir = tempfile.mkdtemp(prefix="trainer-ext-estimate-")
    try:
        proc, ranks = launch_ranks(WORKER, train_argv, num_processes, out_dir, timeout)
        if proc.returncode != 0 or len(ranks) != num_processes:
            raise RuntimeError(f"the measuring run failed (exit {proc.returncode}):\n{output_tail(proc)}")
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    keys = {key for rank in ranks for key in rank}
    measured = {key: max(rank.get(key, 0) for rank in ranks) for key in sorted(keys)}
    measured["ranks"] = ranks
    return measured


def _model_line(shape: Any) -> str:
    return (
        f"model: {shape.model_type}, {shape.params / 1e6:,.2f}M parameters ({shape.trainable / 1e6:,.2f}M trainable), "
        f"{shape.num_layers} layers, hidden {shape.hidden}, intermediate {shape.intermediate}, "
        f"{shape.heads} heads ({shape.kv_heads} kv), vocabulary {shape.vocab}"
    )


def check_json_target(path: str) -> None:
    """ConfigError now, before the estimate and a --measure run, for a --json path the file system refuses
    (too long, a loop of links, a file where a folder should be)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        pass  # a new file: its folder is checked by check_writable
    except OSError as error:
        raise ConfigError(_cannot_write(path, error)) from None


def write_json_file(path: str, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` whole or not at all: a regular file (or a new one) is written beside it and
    renamed over it; a device or FIFO (/dev/stdout, a pipe) is written in place, a FIFO without a reader refused
    rather than waited for. ConfigError with the system's reason (a full disk, an I/O error) on failure."""
    text = json.dumps(document, indent=2, sort_keys=True) + "\n"
    try:
        special = os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode)
        if special:
            fd = os.open(path, os.O_WRONLY | getattr(os, "O_NONBLOCK", 0))
            os.set_blocking(fd, True)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
            return
        folder, name = os.path.split(os.path.abspath(path))
        fd, temporary = tempfile.mkstemp(prefix=f".{name[:100]}.", suffix=".tmp", dir=folder)
        try:
            os.fchmod(fd, _file_mode(path))
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as error:
        raise ConfigError(_cannot_write(path, error)) from None


def _file_mode(path: str) -> int:
    """The mode of the file ``path`` replaces, else what a new file gets under the umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _cannot_write(path: str, error: OSError) -> str:
    why = error.strerror or str(error)
    if error.errno == errno.ENAMETOOLONG:
        return f"--json {path}: the path is too long for the file system ({why}); use a shorter path"
    if error.errno == errno.ENXIO:
        return f"--json {path} is a FIFO that nothing reads; start its reader first or give a file"
    return f"--json {path} cannot be written: {why}"


def run_estimate(argv: Sequence[str]) -> int:
    """Print the estimate (and the measurement); exit 0, 1 when the measuring run failed."""
    from trainer_ext.estimate.breakdown import estimate
    from trainer_ext.estimate.fit import largest_batch, remedies
    from trainer_ext.estimate.job import job_from_argv
    from trainer_ext.estimate.report import check_writable, format_breakdown, json_document
    from trainer_ext.estimate.startup import device_memory_bytes

    parser = build_parser()
    options, train_argv = parser.parse_known_args(list(argv))
    if options.help:
        parser.print_help()
        return 0
    limit = device_memory_bytes(options.device_memory) if options.device_memory is not None else None
    if options.json:
        check_json_target(options.json)
        check_writable(options.json)  # before the estimate and a --measure run, not after
    started = time.perf_counter()
    job = job_from_argv(train_argv, options.num_processes)
    breakdown = estimate(job.shape, job.setup)
    print(_model_line(job.shape))
    if job.mesh:
        print(f"mesh: {job.mesh}")
    for note in job.notes:
        print(f"note: {note}")
    print(f"estimated in {time.perf_counter() - started:.1f}s (model on the meta device), per rank:")
    measured = None
    if options.measure:
        try:
            measured = measure(train_argv, job.setup.world_size)
        except RuntimeError as error:
            print(format_breakdown(breakdown, job.setup, indent="  "))
            print(f"error: {error}", file=sys.stderr)
            return 1
    print(format_breakdown(breakdown, job.setup, measured, indent="  "))
    extra: dict[str, Any] = {}
    if limit is not None:
        batch = largest_batch(job.shape, job.setup, limit)
        extra.update(device_memory=limit, largest_batch=batch)
        print(f"largest micro-batch that fits {format_size(limit)} per device: {batch}")
        if breakdown.peak > limit:
            print(f"the peak {format_size(breakdown.peak)} does not fit {format_size(limit)}; flags that lower it:")
            for remedy in remedies(job.shape, job.setup, limit):
                verdict = "fits" if remedy.fits else "not enough alone"
                print(f"  {remedy.flags:<70} -> {format_size(remedy.peak)} ({verdict})")
    if options.json:
        write_json_file(options.json, json_document(breakdown, job.setup, extra, measured))
    return 0
