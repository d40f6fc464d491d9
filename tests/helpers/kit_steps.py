"""Steps for the GPU kit's orchestrator tests (tests/test_gpu_kit.py): one module, the behaviour chosen by the
step's name. ``hangs`` records a figure, starts a grandchild and never ends; ``crashes`` raises; ``skips`` skips;
``finds`` records a problem; ``naps`` sleeps a second; ``fine`` records a figure."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

from benchmarks.gpu_kit.kit import Context, Skip


def run(ctx: Context) -> None:
    if ctx.name == "hangs":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        ctx.record(before_the_hang=1, grandchild=child.pid)
        time.sleep(600)
    elif ctx.name == "crashes":
        ctx.record(before_the_crash=1)
        raise ValueError("the step broke")
    elif ctx.name == "skips":
        raise Skip("nothing to check here")
    elif ctx.name == "naps":
        time.sleep(1.0)
        ctx.record(value=1.0)
    elif ctx.name == "finds":
        ctx.record(value=2.0)
        ctx.check(False, "value is 2.0, expected 1.0")
    else:
        ctx.record(value=1.0, dry_run=ctx.dry_run, device=ctx.device)


def summarize(figures: dict[str, Any]) -> list[str]:
    return [f"value {figures['value']}"] if "value" in figures else []
