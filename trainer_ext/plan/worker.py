"""One rank of ``trainer-ext plan --verify``: two optimizer steps of the job, its memory measured and the
collectives of its second optimizer step counted.

``python -m trainer_ext.plan.worker OUT_DIR TRAIN_FLAGS...`` (under torch.distributed.run for several ranks) writes
``OUT_DIR/rank<N>.json``: the keys :class:`~trainer_ext.estimate.measure.MeasureCallback` writes (weights,
gradients, optimizer, activations, weight_copies, total) plus ``collectives`` ({collective: bytes} over every
micro-batch of the second optimizer step, :mod:`trainer_ext.plan.counting`'s convention) and ``groups`` (one row per
collective and process group: its global ranks, bytes and calls). The first step is left out: it carries one-off
set-up traffic (parameter broadcasts, bucket rebuilding). :func:`measure_layout` launches it and reads the files.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from trainer_ext import env_vars
from trainer_ext.estimate.worker import RUN_FLAGS, launch_ranks, output_tail

if TYPE_CHECKING:
    from trainer_ext.estimate.setup import Setup
    from trainer_ext.plan.counting import CollectiveCounter

WORKER = "trainer_ext.plan.worker"
COUNTED_STEP = 1  # global_step during the second optimizer step


class CountCallback(TrainerCallback):
    """Counts the collectives of optimizer step ``COUNTED_STEP`` (from its first micro-batch's start to the end of
    its optimizer step: every forward, backward, the clipping and the step itself)."""

    def __init__(self) -> None:
        from trainer_ext.plan.counting import CollectiveCounter

        self.counter: CollectiveCounter = CollectiveCounter()
        self.active = False
        self.done = False

    def _stop(self) -> None:
        if self.active:
            self.counter.__exit__(None, None, None)
            self.active = False
            self.done = True

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == COUNTED_STEP and not self.active and not self.done:
            self.counter.__enter__()
            self.active = True

    def on_step_end(self, args, state, control, **kwargs):
        self._stop()

    def on_train_end(self, args, state, control, **kwargs):
        self._stop()


def main(argv: Sequence[str]) -> int:
    from trainer_ext.estimate.measure import MeasureCallback
    from trainer_ext.job.flags import parse_train_args
    from trainer_ext.job.run import train

    out_dir, train_argv = argv[0], list(argv[1:])
    run_dir = os.path.join(out_dir, "run")  # the same on every rank; the caller removes out_dir
    args = parse_train_args([*train_argv, *RUN_FLAGS, f"--output_dir={run_dir}"])
    counting = CountCallback()
    # the counter outermost in the callback order: it enters before MeasureCallback's hooks and leaves after them
    train(args, callbacks=[counting, MeasureCallback(out_dir)])
    rank = int(os.environ.get(env_vars.RANK, "0") or 0)
    path = os.path.join(out_dir, f"rank{rank}.json")
    result: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            result = json.load(handle)
    result["counted"] = counting.done
    result["collectives"] = counting.counter.by_collective()
    result["groups"] = counting.counter.table()
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    return 0


def _launch(train_argv: Sequence[str], num_processes: int, out_dir: str, timeout: float | None) -> list[dict]:
    proc, ranks = launch_ranks(WORKER, train_argv, num_processes, out_dir, timeout)
    if proc.returncode != 0 or len(ranks) != num_processes or not all(r.get("counted") for r in ranks):
        why = "" if proc.returncode else " (the run ended before its second optimizer step)"
        raise RuntimeError(f"the measuring run failed (exit {proc.returncode}){why}:\n{output_tail(proc)}")
    return ranks


def _largest(tables: list[dict[str, int]]) -> dict[str, int]:
    """The largest value of each key over ``tables`` (absent: 0)."""
    keys = sorted({key for table in tables for key in table})
    return {key: max(table.get(key, 0) for table in tables) for key in keys}


def _per_dimension(rows: list[dict[str, Any]], names: dict[tuple[int, ...], str]) -> dict[str, dict[str, int]]:
    """One rank's counted rows as {collective: {dimension: bytes}}; a group ``names`` does not know is keyed by its
    ranks, received bytes and barriers left out."""
    table: dict[str, dict[str, int]] = {}
    for row in rows:
        if row["collective"] in ("recv", "barrier"):
            continue
        group = tuple(sorted(row["ranks"]))
        name = names.get(group) or "ranks " + ",".join(map(str, group))
        per = table.setdefault(row["collective"], {})
        per[name] = per.get(name, 0) + row["bytes"]
    return table


def measure_layout(
    train_argv: list[str], num_processes: int, timeout: float | None = None, setup: Setup | None = None
) -> dict[str, Any]:
    """Run the job for two optimizer steps on ``num_processes`` local ranks (gloo on CPU) and return the busiest
    rank's memory keys (the largest value of each over the ranks), ``collectives`` ({collective: bytes}, the largest
    over the ranks, of the second optimizer step) and ``ranks`` (each rank's file). With the job's ``setup``,
    ``dimensions`` too: {collective: {mesh dimension: bytes}}, the largest over the ranks, groups named by
    :func:`trainer_ext.plan.comms.dimension_groups`. RuntimeError with the run's last lines when it fails."""
    out_dir = tempfile.mkdtemp(prefix="trainer-ext-plan-")
    try:
        ranks = _launch(train_argv, num_processes, out_dir, timeout)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    numbers = {key for rank in ranks for key, value in rank.items() if isinstance(value, (int, float))}
    measured: dict[str, Any] = {key: max(rank.get(key, 0) for rank in ranks) for key in sorted(numbers - {"counted"})}
    measured["collectives"] = _largest([rank["collectives"] for rank in ranks])
    if setup is not None:
        from trainer_ext.plan.comms import dimension_groups

        names = dimension_groups(setup)
        tables = [_per_dimension(rank["groups"], names) for rank in ranks]
        kinds = sorted({kind for table in tables for kind in table})
        measured["dimensions"] = {kind: _largest([table.get(kind, {}) for table in tables]) for kind in kinds}
    measured["ranks"] = ranks
    return measured


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
