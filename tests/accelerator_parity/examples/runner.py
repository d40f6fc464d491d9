"""One rank of one of accelerate's example scripts, run unchanged (stock) or with its imports switched (ours), and
what it did recorded.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.accelerator_parity.examples.runner \
        --impl ours --record OUT.json upstream/nlp_example.py --cpu

(from the repository root, or with it on PYTHONPATH; the working directory holds the stand-ins, ``standins.py``).
``ours`` runs a copy whose top-level ``from accelerate[.utils|.logging|.local_sgd] import X`` lines read
``from trainer_ext import X`` and nothing else changed, with accelerate hidden from the import system (as where it
is not installed). Hooks on the implementation's ``Accelerator`` class record, without touching the script: each
``backward(loss)`` (the loss, the prepared optimizers' learning rates, ``sync_gradients``), each ``log``, each
metric ``compute``, and, when the script calls ``end_training`` (or else when it returns), the prepared model's
unwrapped weights. Rank N writes ``OUT.rankN.json``; rank 0 writes the weights to ``OUT.weights.safetensors``.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import os
import re
import runpy
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

# top-level accelerate imports the switch rewrites (the examples' only ones; an indented one sits in a branch for
# accelerate's own tests, not taken here)
IMPORT_LINE = re.compile(r"^from accelerate(?:\.utils|\.logging|\.local_sgd)? import (?P<names>.+)$")
ANY_ACCELERATE_IMPORT = re.compile(r"^(?:from|import) accelerate\b")


def switch_imports(source: str) -> tuple[str, list[str]]:
    """``source`` with its accelerate import lines switched to trainer_ext; also the lines switched."""
    lines, switched = [], []
    for line in source.splitlines(keepends=True):
        match = IMPORT_LINE.match(line.rstrip("\n"))
        if match:
            switched.append(line.rstrip("\n"))
            line = f"from trainer_ext import {match['names']}\n"
        elif ANY_ACCELERATE_IMPORT.match(line):
            raise ValueError(f"an accelerate import this switch does not rewrite: {line.strip()!r}")
        lines.append(line)
    return "".join(lines), switched


class Recording:
    """What one rank saw through the hooks."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.logs: list[dict[str, Any]] = []
        self.metrics: list[Any] = []
        self.models: list[Any] = []
        self.optimizers: list[Any] = []
        self.accelerator: Any = None
        self.weights: dict[str, Any] | None = None
        self.topology: dict[str, Any] = {}


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def _is_optimizer(obj: Any) -> bool:
    return hasattr(obj, "param_groups") and hasattr(obj, "zero_grad") and not hasattr(obj, "get_last_lr")


def install_hooks(accelerator_class: type, recording: Recording) -> None:
    """Wrap ``prepare``, ``backward``, ``log`` and ``end_training`` of ``accelerator_class``, and metric ``compute``."""
    import evaluate
    import torch

    prepare, backward, log, end_training = (
        accelerator_class.prepare,
        accelerator_class.backward,
        accelerator_class.log,
        accelerator_class.end_training,
    )
    compute = evaluate.EvaluationModule.compute

    def prepare_hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = prepare(self, *args, **kwargs)
        returned = result if isinstance(result, tuple) else (result,)
        recording.accelerator = self
        models = [obj for obj in returned if isinstance(obj, torch.nn.Module)]
        optimizers = [obj for obj in returned if _is_optimizer(obj)]
        if models:  # a script that prepares again (after free_memory) trains the new ones
            recording.models = models
        if optimizers:
            recording.optimizers = optimizers
        return result

    def backward_hook(self: Any, loss: Any, **kwargs: Any) -> Any:
        lrs = [float(group["lr"]) for opt in recording.optimizers for group in opt.param_groups]
        recording.steps.append({"loss": float(loss.detach().float().item()), "lr": lrs, "sync": self.sync_gradients})
        return backward(self, loss, **kwargs)

    def log_hook(self: Any, values: dict, *args: Any, **kwargs: Any) -> Any:
        step = args[0] if args else kwargs.get("step")
        recording.logs.append({"values": _jsonable(values), "step": step})
        return log(self, values, *args, **kwargs)

    def end_training_hook(self: Any) -> Any:
        snapshot(self, recording)
        return end_training(self)

    def compute_hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        """The metric's compute, its result recorded (evaluate copies the function and appends to this text)."""
        result = compute(self, *args, **kwargs)
        recording.metrics.append(_jsonable(result))
        return result

    accelerator_class.prepare = functools.wraps(prepare)(prepare_hook)
    accelerator_class.backward = functools.wraps(backward)(backward_hook)
    accelerator_class.log = functools.wraps(log)(log_hook)
    accelerator_class.end_training = functools.wraps(end_training)(end_training_hook)
    evaluate.EvaluationModule.compute = functools.wraps(compute)(compute_hook)


def snapshot(accelerator: Any, recording: Recording) -> None:
    """The last prepared model's full weights (every rank takes part: FSDP gathers), and the topology."""
    if recording.weights is not None or not recording.models:
        return
    state = accelerator.get_state_dict(recording.models[-1])
    recording.weights = {k: v.detach().cpu().clone().contiguous() for k, v in state.items()}
    recording.topology = {
        "distributed_type": str(accelerator.distributed_type),
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
    }


def record_path(record: Path, rank: int) -> Path:
    return record.with_name(f"{record.stem}.rank{rank}.json")


def weights_path(record: Path) -> Path:
    return record.with_name(f"{record.stem}.weights.safetensors")


def run(impl: str, record: Path, script: Path, args: list[str]) -> None:
    """Run ``script`` under ``impl`` with the hooks; write this rank's record (with what the script raised, if it
    did: the rank still exits 0, so that the launcher does not stop its peers before they have written theirs)."""
    rank = int(os.environ.get("RANK", "0"))
    result: dict[str, Any] = {"impl": impl, "script": script.name, "args": args, "rank": rank, "switched": []}
    recording = Recording()
    try:
        if impl == "ours":
            import trainer_ext

            accelerator_class = trainer_ext.Accelerator
            source, result["switched"] = switch_imports(script.read_text())
            copy = Path(tempfile.mkdtemp(prefix="ours-script-")) / script.name
            copy.write_text(source)
            script = copy
        else:
            import accelerate

            accelerator_class = accelerate.Accelerator
        install_hooks(accelerator_class, recording)
        sys.argv = [str(script), *args]
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
        if recording.accelerator is not None:
            snapshot(recording.accelerator, recording)
        result["returned"] = True
    except BaseException as exc:  # what the script raised: recorded and compared
        result["error"] = {"type": type(exc).__name__, "message": str(exc)[:2000]}
        traceback.print_exc()
        if recording.accelerator is not None:
            try:  # the weights it had reached (every rank raises at the same point in a script that fails here)
                snapshot(recording.accelerator, recording)
            except Exception:
                traceback.print_exc()
    result.update(
        steps=recording.steps,
        logs=recording.logs,
        metrics=recording.metrics,
        topology=recording.topology,
        accelerate_imported="accelerate" in sys.modules,
    )
    record.parent.mkdir(parents=True, exist_ok=True)
    if recording.weights is not None and rank == 0:
        from safetensors.torch import save_file

        save_file(recording.weights, str(weights_path(record)))
        result["weights"] = weights_path(record).name
    record_path(record, rank).write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=("stock", "ours"), required=True)
    parser.add_argument("--record", required=True, help="OUT.json: rank N writes OUT.rankN.json")
    parser.add_argument("script", help="the example script (run unchanged, or with its imports switched)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    options = parser.parse_args(argv)
    faulthandler.register(signal.SIGTERM, chain=True)  # stopped after a hang or a peer's crash: say where
    from tests.parity_harness.workload import die_with_launcher, leave_without_teardown, set_up

    die_with_launcher()
    set_up(options.impl)
    os.environ["HF_EVALUATE_OFFLINE"] = "1"
    import torch

    torch.set_num_threads(1)
    run(options.impl, Path(options.record).resolve(), Path(options.script).resolve(), options.args)
    if options.impl == "stock":
        leave_without_teardown()  # accelerate's gloo teardown aborts now and then; everything is recorded by now
    return 0


if __name__ == "__main__":
    sys.exit(main())
