"""Run a script on N real gloo ranks through torchrun on loopback (free port, never a fixed one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_ranks(script: Path | str, nproc: int, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc script args``; raises with the output on failure."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")])
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "--max_restarts=0",
        str(script),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{nproc}-rank run failed (exit {proc.returncode})\nSTDOUT:\n{proc.stdout[-5000:]}\n"
            f"STDERR:\n{proc.stderr[-8000:]}"
        )
    return proc
