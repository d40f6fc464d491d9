"""A hand-written loop under ``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=1)`` whose second
``save_state()`` fails or is killed; a later process resumes with ``load_state()``.

``python -m tests.checkpointing.rotation_fault_job MODE DIR``, the project in ``DIR/project``:

- ``fsize``: the second save hits the file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: every write past it fails
  with EFBIG, File too large, as a full disk fails with ENOSPC); writes ``DIR/failed.json`` (the error, the folders left).
- ``hang-hook`` / ``hang-object``: the second save blocks (in a save-state pre-hook, before anything is written;
  or in a registered object's ``state_dict``, after the model and optimizer files) after touching ``DIR/blocked``,
  for the test to SIGKILL it.
- ``resume``: a new process loads the newest checkpoint, compares everything with ``DIR/expected.pt`` (what the
  first save saw), saves again, and writes ``DIR/resumed.json``.
"""

from __future__ import annotations

import json
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from trainer_ext import Accelerator, ProjectConfiguration


class Counter:
    """A registered object; with ``hang`` its ``state_dict`` blocks (the save is then killed from outside)."""

    def __init__(self, blocked: Path | None = None) -> None:
        self.count = torch.zeros(1)
        self.blocked = blocked

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.blocked is not None:
            _block(self.blocked)
        return {"count": self.count.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.count = state["count"].clone()


def _block(blocked: Path) -> None:
    blocked.write_text("")
    while True:
        time.sleep(1)


def _setup(project: Path, blocked: Path | None = None) -> tuple[Accelerator, Any, Any, Any, Counter]:
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True, total_limit=1)
    accelerator = Accelerator(cpu=True, project_config=config)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    counter = Counter(blocked)
    accelerator.register_for_checkpointing(counter)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler, counter


def _train(accelerator: Accelerator, model: Any, optimizer: Any, scheduler: Any, counter: Counter) -> None:
    for _ in range(3):
        x = torch.randn(8, 16)
        accelerator.backward(model(x).pow(2).mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter.count += 1


def _snapshot(model: Any, optimizer: Any, scheduler: Any, counter: Counter) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "count": counter.count.clone(),
        "rng": torch.get_rng_state(),
    }


def _listing(project: Path) -> list[str]:
    return sorted(p.name for p in (project / "checkpoints").iterdir())


def first_then_second(mode: str, out: Path) -> None:
    """Save checkpoint_0 (recording what it holds), train on, then the second save that fails or blocks."""
    project = out / "project"
    accelerator, model, optimizer, scheduler, counter = _setup(project)
    _train(accelerator, model, optimizer, scheduler, counter)
    expected = _snapshot(model, optimizer, scheduler, counter)
    assert Path(accelerator.save_state()).name == "checkpoint_0"
    torch.save(expected, out / "expected.pt")
    _train(accelerator, model, optimizer, scheduler, counter)
    if mode == "fsize":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            accelerator.save_state()
            failure = None
        except Exception as error:  # safetensors and torch.save word the kernel's error their own way
            failure = f"{type(error).__name__}: {error}"
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        result = {"error": failure, "left": _listing(project), "iteration": accelerator.save_iteration}
        (out / "failed.json").write_text(json.dumps(result))
        return
    if mode == "hang-hook":
        accelerator.register_save_state_pre_hook(lambda models, weights, folder: _block(out / "blocked"))
    else:
        counter.blocked = out / "blocked"
    accelerator.save_state()
    raise AssertionError("the second save was meant to block until killed")


def resume(out: Path) -> None:
    """A new process: load_state() restores checkpoint_0 exactly; the next save is checkpoint_1 and rotates."""
    project = out / "project"
    accelerator, model, optimizer, scheduler, counter = _setup(project)
    torch.manual_seed(123)  # a different random state, which the load must replace
    expected = torch.load(out / "expected.pt", weights_only=False)
    accelerator.load_state()
    now = _snapshot(model, optimizer, scheduler, counter)
    same = {
        "model": all(torch.equal(v, expected["model"][k]) for k, v in now["model"].items()),
        "optimizer": _equal(now["optimizer"], expected["optimizer"]),
        "scheduler": now["scheduler"] == expected["scheduler"],
        "count": torch.equal(now["count"], expected["count"]),
        "rng": torch.equal(now["rng"], expected["rng"]),
    }
    before = _listing(project)
    _train(accelerator, model, optimizer, scheduler, counter)
    saved = Path(accelerator.save_state()).name
    result = {"same": same, "before_save": before, "saved": saved, "after_save": _listing(project)}
    (out / "resumed.json").write_text(json.dumps(result))


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


if __name__ == "__main__":
    mode, directory = sys.argv[1], Path(sys.argv[2])
    if mode == "resume":
        resume(directory)
    else:
        first_then_second(mode, directory)
