"""Every name transformers and TRL read from ``trainer.accelerator`` (and its ``state`` and ``gradient_state``) exists
on our engine, read from the installed packages' source: an upgrade that reads a new name fails here.

A read counts where the object is ``self.accelerator``, ``trainer.accelerator``, ``self.trainer.accelerator``, or a
function's ``accelerator`` that is a parameter or was assigned from one of those.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from trainer_ext.distributed.engine import Engine
from trainer_ext.distributed.state import DistState

# names read only on paths we do not take, each with the reason
NOT_READ_BY_OUR_PATHS = {
    ("accelerator", "deepspeed_ulysses_dl_adapter"): "only with parallelism_config.sp_backend='deepspeed' (no SP yet)",
}


# model and tokenizer code never holds a trainer (transformers' models/ alone is 2,000 files)
SKIPPED_FOLDERS = {"models", "quantizers", "kernels", "cli", "commands"}


def _owner(node: ast.AST) -> bool:
    """``X.accelerator`` where X is ``self``, ``trainer``, ``self.trainer`` or ``self._trainer``."""
    if not (isinstance(node, ast.Attribute) and node.attr == "accelerator"):
        return False
    base = node.value
    if isinstance(base, ast.Name):
        return base.id in ("self", "trainer")
    return isinstance(base, ast.Attribute) and base.attr in ("trainer", "_trainer")


def _local_engines(function: ast.AST) -> bool:
    """Does ``function`` take ``accelerator`` as a parameter or assign it from an engine attribute?"""
    if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        names = [a.arg for a in function.args.args + function.args.kwonlyargs]
        if "accelerator" in names:
            return True
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and _owner(node.value):
            if any(isinstance(t, ast.Name) and t.id == "accelerator" for t in node.targets):
                return True
    return False


def reads(package: str) -> dict[tuple[str, str], set[str]]:
    """(object, name) -> where: object is ``accelerator``, ``state`` or ``gradient_state``."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.origin is not None
    root = Path(spec.origin).parent
    found: dict[tuple[str, str], set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] in SKIPPED_FOLDERS:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        local = {id(n) for f in functions if _local_engines(f) for n in ast.walk(f)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            base = node.value
            engine = _owner(base) or (isinstance(base, ast.Name) and base.id == "accelerator" and id(base) in local)
            where = f"{package}/{path.relative_to(root)}:{node.lineno}"
            if engine:
                found.setdefault(("accelerator", node.attr), set()).add(where)
            elif isinstance(base, ast.Attribute) and base.attr in ("state", "gradient_state"):
                inner = base.value
                if _owner(inner) or (isinstance(inner, ast.Name) and inner.id == "accelerator" and id(inner) in local):
                    found.setdefault((base.attr, node.attr), set()).add(where)
    return found


def _engine() -> Engine:
    return Engine(DistState())


def _has(obj: object, name: str) -> bool:
    return hasattr(obj, name) or hasattr(type(obj), name)


def missing_names(package: str) -> list[str]:
    """The names ``package``'s source reads from ``trainer.accelerator`` (and its states) that our engine lacks."""
    engine = _engine()
    objects = {"accelerator": engine, "state": engine.state, "gradient_state": engine.gradient_state}
    found = reads(package)
    assert ("accelerator", "prepare") in found  # the scan sees the reads it is meant to see
    return [
        f"{owner}.{name} (read at {sorted(where)[0]})"
        for (owner, name), where in sorted(found.items())
        if (owner, name) not in NOT_READ_BY_OUR_PATHS and not _has(objects[owner], name)
    ]


def test_every_name_transformers_reads_from_the_engine_exists() -> None:
    missing = missing_names("transformers")
    assert not missing, "names read from trainer.accelerator that the engine lacks:\n" + "\n".join(missing)


def test_accelerate_names_mean_what_they_mean_there(capsys: pytest.CaptureFixture[str]) -> None:
    engine = _engine()
    engine.print("printed", end="!")
    assert capsys.readouterr().out == "printed!"
    assert engine.clear() == ()
    assert engine.dataloader_config.dispatch_batches is None
    engine.dataloader_config.dispatch_batches = False  # GRPO/RLOO with an iterable eval set
    assert engine.dispatch_batches is False
    with pytest.raises(AttributeError, match="cannot be changed"):
        engine.dataloader_config.non_blocking = True  # the engine has no non-blocking transfers: refuse, not ignore
    with engine.split_between_processes(["a", "b", "c"]) as share:
        assert share == ["a", "b", "c"]  # one process: everything
    assert engine.is_last_process and not engine.use_distributed
    assert engine.torch_device_mesh is None
    with engine.maybe_context_parallel(buffers=[], buffer_seq_dims=[], no_restore_buffers=set()):
        pass
