"""``python -m benchmarks.gpu_kit.child STEP --result FILE --work DIR [--dry_run]``: one step of the kit, in this
process (the orchestrator time-boxes it). Exit 0 when the step ran (its problems are in FILE), 3 when it skipped."""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from pathlib import Path

from benchmarks.gpu_kit.kit import Context, Skip

SKIPPED = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("module", help="the step's module, e.g. benchmarks.gpu_kit.dispatch_step")
    parser.add_argument("--name", required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--dry_run", action="store_true")
    opts = parser.parse_args(argv)
    ctx = Context(opts.name, opts.dry_run, opts.device, opts.work, opts.result)
    ctx.record()  # the result file exists from the start
    try:
        importlib.import_module(opts.module).run(ctx)
    except Skip as skip:
        ctx.record(skipped=str(skip))
        print(f"skipped: {skip}", flush=True)
        return SKIPPED
    except Exception as exc:  # the orchestrator reports it; the next step runs anyway
        traceback.print_exc()
        ctx.record(error=f"{type(exc).__name__}: {exc}"[-3000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
