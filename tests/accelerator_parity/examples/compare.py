"""Compare what stock and ours recorded for one case, and run every case under both (a table at the end).

    python -m tests.accelerator_parity.examples.compare                      # every case, 1 and 2 processes
    python -m tests.accelerator_parity.examples.compare -k nlp --nproc 2 --outdir /tmp/examples-parity

(from the repository root, in an environment with accelerate). Per phase and rank: the phase's status, the number of
``backward`` calls, each one's loss and learning rates (relative 1e-6) and ``sync_gradients``, every metric
``compute`` and every ``log`` (floats relative 1e-6), rank 0's final weights (max absolute difference 1e-6), and
that ours never imported accelerate. Every difference fails, except the two in ``ALLOWED`` (each with its reason,
reported as a note):

- a resumed phase where stock's own resume is not its uninterrupted run's continuation (accelerate reshuffles a
  plain shuffled loader on resume): ours must continue the uninterrupted run exactly instead (``_continues``), the
  run stock and ours already agree on;
- ``ddp_comm_hook`` on one process: accelerate under torchrun wraps a one-process DDP, so its fp16 compression hook
  rounds every gradient; ours has no DDP on one process (as accelerate without a launcher), so only the final
  weights may differ, by at most ``COMM_HOOK_WEIGHTS_ABS``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers.slowness import scaled
from tests.parity_harness.compare import relative, worst_of
from tests.parity_harness.registry import IMPLS, matching
from tests.parity_harness.runner import batch_command, result_path, side_by_side

from .batch import record_path
from .cases import CASES, NPROCS
from .runner import record_path as rank_record

RELATIVE = 1e-6  # losses, learning rates, metrics, logged values
WEIGHTS_ABS = 1e-6
COMM_HOOK_WEIGHTS_ABS = 1e-4  # fp16-rounded gradients over a few steps of AdamW at lr 2e-5
ALLOWED = {
    "stock_resume_reshuffles": "accelerate reshuffles a plain shuffled loader on resume (its resumed run is not the "
    "uninterrupted run's continuation); ours continues it, checked against the uninterrupted run",
    "one_process_comm_hook": "on one process accelerate under torchrun wraps a DDP whose fp16 comm hook rounds the "
    "gradients; ours has no DDP on one process (as accelerate without a launcher)",
}
BATCH_TIMEOUT_S = 900.0  # one implementation's whole batch (a hang guard, scaled by the caller's helpers)


@dataclass
class Report:
    case: str
    nproc: int
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    worst: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def err(self, kind: str, value: float) -> None:
        worst_of(self.worst, kind, value)

    def text(self) -> str:
        worst = ", ".join(f"{k} {v:.3g}" for k, v in sorted(self.worst.items()))
        lines = [f"{self.case} on {self.nproc} process(es): {'pass' if self.ok else 'FAIL'} (largest errors: {worst})"]
        lines += [f"  FAIL {line}" for line in self.failures] + [f"  note {line}" for line in self.notes]
        return "\n".join(lines)


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key in sorted(value):
            yield from _leaves(value[key], f"{path}.{key}")
    elif isinstance(value, list):
        yield path + ".len", len(value)
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    else:
        yield path, value


def _values(report: Report, where: str, kind: str, stock: Any, ours: Any) -> None:
    """Nested values: the same structure, numbers within RELATIVE, everything else equal; the first difference."""
    pairs = list(zip(_leaves(stock), _leaves(ours), strict=False))
    if len(list(_leaves(stock))) != len(list(_leaves(ours))):
        report.failures.append(f"{where}: {kind} differ in shape: stock {stock!r:.300} ours {ours!r:.300}")
        return
    for (path, a), (path_b, b) in pairs:
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
        if path != path_b or (not numbers and a != b):
            report.failures.append(f"{where}: {kind}{path}: stock {a!r} ours {b!r}")
            return
        if numbers:
            error = relative(float(a), float(b))
            report.err(kind, error)
            if error > RELATIVE:
                report.failures.append(f"{where}: {kind}{path}: stock {a!r} ours {b!r} (relative {error:.3g})")
                return


def _steps(report: Report, where: str, stock: list[dict], ours: list[dict]) -> None:
    """Per backward call: loss, learning rates, sync_gradients; the first differing step with its values."""
    if len(stock) != len(ours):
        report.failures.append(f"{where}: {len(stock)} backward calls in stock, {len(ours)} in ours")
    differing = []
    for i, (a, b) in enumerate(zip(stock, ours, strict=False)):
        loss = relative(a["loss"], b["loss"])
        report.err("loss", loss)
        lrs = [relative(x, y) for x, y in zip(a["lr"], b["lr"], strict=False)] or [0.0]
        report.err("lr", max(lrs))
        if loss > RELATIVE or max(lrs) > RELATIVE or len(a["lr"]) != len(b["lr"]) or a["sync"] != b["sync"]:
            differing.append((i, a, b))
    if differing:
        i, a, b = differing[0]
        report.failures.append(
            f"{where}: step {i} (of {len(stock)}) first differs: loss stock {a['loss']!r} ours {b['loss']!r}, "
            f"lr stock {a['lr']} ours {b['lr']}, sync stock {a['sync']} ours {b['sync']} "
            f"({len(differing)} steps differ)"
        )


def _weights(report: Report, where: str, stock: Path, ours: Path) -> None:
    from safetensors.torch import load_file

    a, b = load_file(str(stock)), load_file(str(ours))
    if sorted(a) != sorted(b):
        report.failures.append(f"{where}: weight names differ: {sorted(set(a) ^ set(b))[:10]}")
        return
    worst, name = 0.0, ""
    for key in sorted(a):
        if a[key].shape != b[key].shape:
            report.failures.append(f"{where}: {key} shape stock {tuple(a[key].shape)} ours {tuple(b[key].shape)}")
            return
        diff = (a[key].double() - b[key].double()).abs().max().item() if a[key].numel() else 0.0
        if diff > worst:
            worst, name = diff, key
    report.err("weights", worst)
    if worst > WEIGHTS_ABS:
        report.failures.append(f"{where}: final weights differ: max abs {worst:.3g} (largest in {name})")


def _continues(report: Report, impl: str, case: str, nproc: int, outdir: Path) -> None:
    """Whether ``impl``'s resumed phase replays the uninterrupted run's last steps and ends on its weights (ours:
    a failure if not, as its own invariant; stock: a note)."""
    differences = _not_continued(impl, case, nproc, outdir)
    if differences:
        line = f"{impl}: the resumed run is not the uninterrupted run's continuation: {'; '.join(differences)}"
        (report.failures if impl == "ours" else report.notes).append(line)
    else:
        report.notes.append(f"{impl}: the resumed run replays the uninterrupted run's last steps and weights exactly")


def _not_continued(impl: str, case: str, nproc: int, outdir: Path) -> list[str]:
    """Where ``impl``'s resumed phase departs from the uninterrupted run's last steps and weights (empty: nowhere)."""
    differences = []
    for rank in range(nproc):
        full, resumed = (
            json.loads(rank_record(record_path(outdir, case, impl, nproc, phase), rank).read_text())
            for phase in ("full", "resumed")
        )
        tail = full["steps"][len(full["steps"]) - len(resumed["steps"]) :]
        first = next((i for i, (a, b) in enumerate(zip(tail, resumed["steps"], strict=True)) if a != b), None)
        if first is not None or not resumed["steps"]:
            differences.append(f"rank {rank} from resumed step {first} of {len(resumed['steps'])}")
    folders = {phase: record_path(outdir, case, impl, nproc, phase) for phase in ("full", "resumed")}
    weights = Report(case, nproc)
    names = {phase: json.loads(rank_record(path, 0).read_text()).get("weights") for phase, path in folders.items()}
    if None not in names.values():
        _weights(weights, "", *(folders[phase].parent / names[phase] for phase in ("full", "resumed")))
    return differences + [line.split(": ", 1)[1] for line in weights.failures]


def compare(case: str, nproc: int, outdir: Path) -> Report:
    """Stock's and ours' records of ``case`` on ``nproc`` processes, from ``outdir`` (batch.py's layout)."""
    report = Report(case, nproc)
    summaries = {impl: json.loads(result_path(outdir, case, impl, nproc).read_text()) for impl in IMPLS}
    resumes = [phase for phase, _ in CASES[case].phases] == ["full", "resumed"]
    for phase, _ in CASES[case].phases:
        statuses = {impl: summaries[impl]["phases"][phase]["status"] for impl in IMPLS}
        reshuffled = phase == "resumed" and resumes and bool(_not_continued("stock", case, nproc, outdir))
        if reshuffled:
            report.notes.append(f"{phase}: allowed ({ALLOWED['stock_resume_reshuffles']})")
        if statuses["stock"] != statuses["ours"] or statuses["ours"].startswith("timeout"):
            for impl, status in statuses.items():
                if status != "ok":
                    tail = summaries[impl]["phases"][phase]["log_tail"][-2500:]
                    report.failures.append(f"{phase}: {impl} {status}; its log ends:\n{tail}")
        elif statuses["stock"] != "ok":
            report.notes.append(f"{phase}: both {statuses['stock']} (the script fails here; compared up to that)")
        for rank in range(nproc):
            where = f"{phase} rank {rank}"
            records = {}
            for impl in IMPLS:
                path = rank_record(record_path(outdir, case, impl, nproc, phase), rank)
                records[impl] = json.loads(path.read_text()) if path.exists() else None
            if None in records.values():
                missing = [impl for impl, r in records.items() if r is None]
                report.failures.append(f"{where}: no record from {', '.join(missing)}")
                continue
            stock, ours = records["stock"], records["ours"]
            errors = {impl: record.get("error") for impl, record in records.items()}
            if errors["stock"] != errors["ours"]:
                for impl, error in errors.items():
                    raised = f"raised {error['type']}: {error['message']}" if error else "raised nothing"
                    report.failures.append(f"{where}: {impl} {raised}")
            elif errors["stock"]:
                report.notes.append(f"{where}: both raised {errors['stock']['type']}: {errors['stock']['message']}")
            if ours["accelerate_imported"]:
                report.failures.append(f"{where}: ours imported accelerate")
            if reshuffled:
                continue
            _steps(report, where, stock["steps"], ours["steps"])
            _values(report, where, "metrics", stock["metrics"], ours["metrics"])
            _values(report, where, "logs", stock["logs"], ours["logs"])
            if rank == 0:
                names = [r.get("weights") for r in (stock, ours)]
                if None in names:
                    report.failures.append(f"{where}: final weights missing (stock {names[0]}, ours {names[1]})")
                else:
                    folders = [record_path(outdir, case, impl, nproc, phase).parent for impl in IMPLS]
                    weights = Report(case, nproc)
                    _weights(weights, where, folders[0] / names[0], folders[1] / names[1])
                    report.err("weights", weights.worst.get("weights", 0.0))
                    comm_hook = (case, nproc) == ("ddp_comm_hook", 1)
                    if comm_hook and weights.failures and weights.worst["weights"] <= COMM_HOOK_WEIGHTS_ABS:
                        report.notes.append(f"{weights.failures[0]}: allowed ({ALLOWED['one_process_comm_hook']})")
                    else:
                        report.failures += weights.failures
                topology = {impl: records[impl]["topology"].get("distributed_type") for impl in IMPLS}
                report.notes.append(f"{phase}: {len(stock['steps'])} steps on rank 0; distributed type {topology}")
    if resumes:
        for impl in IMPLS:
            _continues(report, impl, case, nproc, outdir)
    return report


def run_both(cases: list[tuple[str, int]], outdir: Path, standins: Path, timeout: float) -> dict:
    """Each implementation's batch (one process each, side by side); ``{(case, nproc): Report}``.

    ``timeout`` bounds each batch as given: under pytest, conftest scales a subprocess's timeout already."""
    batch = [f"{case}:{nproc}" for case, nproc in cases]
    failures = side_by_side(
        lambda impl: batch_command(
            "tests.accelerator_parity.examples.batch",
            impl,
            "--standins",
            str(standins),
            "--outdir",
            str(outdir),
            *batch,
        ),
        timeout=timeout,
    )
    reports = {}
    for case, nproc in cases:
        missing = [impl for impl in IMPLS if not result_path(outdir, case, impl, nproc).exists()]
        if missing:
            raise RuntimeError(f"{case} on {nproc}: no result from {missing} ({failures})")
        reports[(case, nproc)] = compare(case, nproc, outdir)
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", action="append", default=[], help="only the cases whose name contains this")
    parser.add_argument("--nproc", type=int, action="append", choices=NPROCS, help="only this process count")
    parser.add_argument("--outdir", help="where the results go (default: a temporary folder, kept)")
    options = parser.parse_args(argv)
    from .standins import build

    selected = matching(list(CASES), options.k)
    skipped = {name: CASES[name].missing() for name in selected if CASES[name].missing()}
    cases = [(name, n) for name in selected if name not in skipped for n in options.nproc or NPROCS]
    outdir = Path(options.outdir or tempfile.mkdtemp(prefix="examples-parity-")).resolve()
    started = time.perf_counter()
    reports = run_both(cases, outdir, build(outdir / "standins"), scaled(BATCH_TIMEOUT_S))
    rows = ["| script | procs | result | first difference |", "|---|---|---|---|"]
    for (case, nproc), report in reports.items():
        print(report.text())
        first = report.failures[0].splitlines()[0][:160] if report.failures else ""
        rows.append(f"| {case} | {nproc} | {'pass' if report.ok else 'FAIL'} | {first} |")
    rows += [f"| {name} | - | skipped | {reason} |" for name, reason in skipped.items()]
    print("\n" + "\n".join(rows))
    failed = sum(not r.ok for r in reports.values())
    print(f"\n{len(reports) - failed}/{len(reports)} pass; {time.perf_counter() - started:.0f}s; results in {outdir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
