"""``trainer-ext report RUN_DIR [RUN_DIR ...] [--out DIR]``: curves and a summary of training runs, as PNGs and one
self-contained HTML page."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from trainer_ext.errors import ConfigError
from trainer_ext.report.build import COMPARE_DIR, DEFAULT_SMOOTHING, PAGE, write_report
from trainer_ext.report.reading import one_line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one `error:` line and exit 2 through the CLI, like every other mistake
        raise ConfigError(f"{message} (usage: trainer-ext report RUN_DIR [RUN_DIR ...] [--out DIR])")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trainer-ext report",
        description=(
            "Plot training runs: loss (vs step and tokens), learning rate, gradient norm, throughput, eval metrics, "
            "skipped steps, checkpoints and resumes; several run folders overlay. Writes PNGs and "
            f"{PAGE} (images embedded: open it from disk)."
        ),
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a training run's --output_dir")
    parser.add_argument(
        "--out",
        default=None,
        help=f"where to write (default: RUN_DIR/report for one run, ./{COMPARE_DIR} for several)",
    )
    parser.add_argument(
        "--smoothing",
        type=float,
        default=DEFAULT_SMOOTHING,
        help=f"weight of the moving average over the training loss, 0 (none) to 0.99 (default {DEFAULT_SMOOTHING})",
    )
    parser.add_argument("--partial", action="store_true", help="plot a run that is still training (refused otherwise)")
    return parser


def run_report(argv: Sequence[str]) -> int:
    """Write the report; bad input raises ConfigError (one ``error:`` line, exit 2, from the CLI's main)."""
    args = _parser().parse_args(list(argv))
    began = time.perf_counter()
    notes: list[str] = []
    try:
        page = write_report(args.run_dirs, args.out, allow_running=args.partial, smoothing=args.smoothing, notes=notes)
    except ConfigError as error:  # one line, whatever the names in it hold (a folder named with a newline)
        raise ConfigError(one_line(str(error))) from error
    figures = sorted(p.name for p in page.parent.glob("*.png"))
    print(one_line(f"report written to {page} ({len(figures)} figures, {time.perf_counter() - began:.1f} s)"))
    for line in notes:  # what was skipped or bounded, as the page lists it
        print(one_line(f"left out: {line}"))
    return 0
