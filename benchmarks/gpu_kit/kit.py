"""What every step of the GPU kit shares: its context (figures, problems, scratch folder) and child processes.

A step runs in its own process (``python -m benchmarks.gpu_kit.child``); it records figures as it goes, so a step
stopped at its time box still leaves what it measured. Its own children (one per framework or launch) print their
result as the last JSON line of their stdout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.run import peak_bf16_flops  # noqa: F401  (the kit's steps read the peak and memory from here)
from benchmarks.run import peak_memory_mb as device_memory_mb  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent.parent


class Skip(Exception):
    """The step cannot run here (no GPU of the kind, a package missing); the message says why."""


class ChildFailed(RuntimeError):
    """A child process of a step exited non-zero or timed out; the message ends with its output's tail."""


class Context:
    """One step's run: where it writes, whether it is the CPU dry run, and what it has recorded so far."""

    def __init__(self, name: str, dry_run: bool, device: str, work: Path, result_file: Path) -> None:
        self.name, self.dry_run, self.device, self.work, self.result_file = name, dry_run, device, work, result_file
        self.figures: dict[str, Any] = {}
        self.problems: list[str] = []
        self.notes: list[str] = []
        work.mkdir(parents=True, exist_ok=True)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def record(self, **figures: Any) -> None:
        """Add figures and write them at once (a step stopped later keeps them)."""
        self.figures.update(figures)
        self._write()

    def problem(self, text: str) -> None:
        """Something the step found wrong: the step ends as ``problems`` (its figures still count)."""
        print(f"PROBLEM: {text}", flush=True)
        self.problems.append(text)
        self._write()

    def note(self, text: str) -> None:
        """Something a reader of the summary should know (a sub-run skipped and why)."""
        print(f"note: {text}", flush=True)
        self.notes.append(text)
        self._write()

    def check(self, ok: bool, text: str) -> bool:
        """``problem(text)`` unless ``ok``; returns ``ok``."""
        if not ok:
            self.problem(text)
        return ok

    def _write(self) -> None:
        data = {"figures": self.figures, "problems": self.problems, "notes": self.notes}
        tmp = self.result_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        tmp.replace(self.result_file)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for this step's children: the repository importable after whatever PYTHONPATH holds (an
        installed trainer_ext first), one OpenMP thread per process on the CPU."""
        env = dict(os.environ)
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT)])
        if not self.cuda:
            env.setdefault("OMP_NUM_THREADS", "1")
            env.setdefault("DS_ACCELERATOR", "cpu")
        env.update(extra)
        return env

    def python(self, args: list[str], timeout: float = 600, label: str = "", **env: str) -> dict[str, Any]:
        """Run ``python args`` in the repository root; its last JSON line. ChildFailed on failure."""
        return last_json(self.run([sys.executable, *args], timeout=timeout, label=label, **env))

    def torchrun(self, args: list[str], nproc: int = 1, timeout: float = 600, label: str = "", **env: str) -> dict:
        """``python -m torch.distributed.run --nproc_per_node nproc args`` on loopback; the last JSON line."""
        from benchmarks.run import torchrun_args

        return last_json(self.run([sys.executable, *torchrun_args(nproc), *args], timeout, label, **env))

    def run(self, cmd: list[str], timeout: float = 600, label: str = "", **env: str) -> str:
        """Run ``cmd`` (its own process group, killed whole at ``timeout``); its stdout, echoed with its stderr."""
        label = label or " ".join(cmd[1:4])
        started = time.perf_counter()
        print(f"--- {label}: {' '.join(cmd)}", flush=True)
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=self.env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            out, err = proc.communicate()
            sys.stdout.write(out[-4000:] + err[-4000:])
            raise ChildFailed(f"{label}: stopped after {timeout:.0f} s\n{tail(out, err)}") from None
        sys.stdout.write(out[-20000:])
        sys.stdout.write(err[-20000:])
        print(f"--- {label}: exit {proc.returncode} after {time.perf_counter() - started:.1f} s", flush=True)
        if proc.returncode != 0:
            raise ChildFailed(f"{label}: exit {proc.returncode}\n{tail(out, err)}")
        return out


def kill_group(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and everything it started (it leads its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tail(out: str, err: str, lines: int = 25) -> str:
    """The last lines of a child's output, stderr last (where a traceback ends)."""
    text = "\n".join(part for part in (out.strip(), err.strip()) if part)
    return "\n".join(text.splitlines()[-lines:])


def last_json(stdout: str) -> dict[str, Any]:
    """The result a child printed (``benchmarks.run.last_json``); ChildFailed when it printed none."""
    from benchmarks.run import last_json as read

    try:
        return read(stdout)
    except ValueError as exc:
        raise ChildFailed(str(exc)) from None


def emit(result: dict[str, Any]) -> None:
    """A child's result: one JSON line on stdout (the last one the step reads)."""
    print(json.dumps(result, default=float), flush=True)


def rel_diff(a: list[float], b: list[float]) -> float:
    """The largest relative difference between two curves of the same length, |a - b| / |b|."""
    if len(a) != len(b):
        raise ValueError(f"curves of different lengths: {len(a)} and {len(b)}")
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True)), default=0.0)


def hide_accelerate() -> None:
    """From now on this process cannot import accelerate (nor peft, which needs it), as where it is not installed:
    trainer_ext's runs start with this, so transformers sees no accelerate and any import of it by ours fails."""
    from tests.parity_harness.workload import hide_accelerate as hide

    hide()


def accelerate_imported() -> bool:
    """Whether this process has imported accelerate (trainer_ext's runs must not)."""
    return any(m == "accelerate" or m.startswith("accelerate.") for m in sys.modules)


def has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
