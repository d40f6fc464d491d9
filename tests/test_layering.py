"""The package's layers import downwards only, and generic code never names a backend.

CLI -> job API -> Trainer/Accelerator -> engine -> strategies -> checkpoint I/O and leaf modules. Read from the
source (``ast``), so a violation fails here with the file and the line, before it becomes an import cycle.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "trainer_ext"

# leaf modules: anyone may import them, they import nothing of ours but errors.py
LEAVES = {"errors", "values", "config_files", "env_vars"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import of a trainer_ext module in ``path``, lazy ones included."""
    return _imports_of(path.read_text(encoding="utf-8"), _module_name(path), path.name == "__init__.py")


def _imports_of(text: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    tree = ast.parse(text)
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
            found += [(node.lineno, n) for n in names if n.startswith("trainer_ext")]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("trainer_ext")]
    return found


def _sources(*folders: str) -> list[Path]:
    out: list[Path] = []
    for folder in folders:
        target = PACKAGE / folder
        out += [target] if target.suffix == ".py" else sorted(target.rglob("*.py"))
    return out


def _violations(files: list[Path], allowed: tuple[str, ...]) -> list[str]:
    bad = []
    for path in files:
        own = _module_name(path)
        for line, name in _imports(path):
            inside = name == own or name.startswith(own.rsplit(".", 1)[0] + ".") and own.count(".") > 1
            if inside or any(name == a or name.startswith(a + ".") for a in allowed):
                continue
            bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    return bad


def test_leaf_modules_import_only_errors() -> None:
    files = [PACKAGE / f"{name}.py" for name in sorted(LEAVES)]
    assert _violations(files, ("trainer_ext.errors",)) == []


def test_checkpoint_io_sits_below_the_engine() -> None:
    """checkpointing/ (commit markers, verification, sharded files) never imports the engine or anything above."""
    allowed = (
        "trainer_ext.checkpointing",
        "trainer_ext.checkpointing.saving",
        *(f"trainer_ext.{m}" for m in LEAVES),
    )
    assert _violations(_sources("checkpointing"), allowed) == []


def test_distributed_imports_nothing_above_it() -> None:
    allowed = (
        "trainer_ext.distributed",
        "trainer_ext.checkpointing",
        "trainer_ext.checkpointing.saving",
        *(f"trainer_ext.{m}" for m in LEAVES),
    )
    assert _violations(_sources("distributed"), allowed) == []


def test_only_the_entry_point_imports_the_cli() -> None:
    outside = [p for p in PACKAGE.rglob("*.py") if "cli" not in p.relative_to(PACKAGE).parts]
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
        for path in outside
        if path.name != "__main__.py"
        for line, name in _imports(path)
        if name.startswith("trainer_ext.cli")
    ]
    assert bad == []


# generic code: it calls the strategy interface and never asks which backend it is, nor what the backend takes over
GENERIC = (
    *(f"distributed/{name}.py" for name in ("engine", "optimizer", "precision", "accumulation", "state", "rules")),
    *(f"distributed/{name}.py" for name in ("collectives", "engine_names")),
    *(f"accelerator/{name}.py" for name in ("accelerator", "checkpoints", "options", "processes", "scheduler")),
    *(f"accelerator/{name}.py" for name in ("setup", "tracking", "preparing", "step")),
    "trainer/trainer.py",
    "trainer/sharded.py",
    "trainer/checkpoints.py",
    "trainer/training_args.py",
)
BACKEND_WORDS = (
    "hf_config",
    "is_engine",
    "is_sharded",
    "strategy.engine",
    "is_zero3",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    # capability flags that were "is it DeepSpeed" under other names: the strategy's hooks do the work instead
    "owns_accumulation",
    "owns_mixed_precision",
    "owns_loss_scaling",
    "joint_prepare",
    "wraps_for_evaluation",
    "own_checkpoint_format",
    "backward_and_step",
)
# generic files that must speak a public API naming the backend, so their code may say "deepspeed": accelerate's
# Accelerator(deepspeed_plugin=...) and our deepspeed_config= (mapped to the registry name in accelerator_setup),
# transformers' args.hf_deepspeed_config / trainer.is_deepspeed_enabled and its --deepspeed/--fsdp flags (the
# registry's strategies read them), accelerate's AcceleratorState (DistributedType.DEEPSPEED, deepspeed_plugin)
SPEAKS_BACKEND_API = (
    "accelerator/accelerator.py",
    "accelerator/setup.py",
    "accelerator/preparing.py",
    "trainer/trainer.py",
    "trainer/training_args.py",
    "distributed/state.py",
)


@pytest.mark.parametrize("relative", GENERIC)
def test_generic_code_never_names_a_backend(relative: str) -> None:
    path = PACKAGE / relative
    backend_imports = [
        f"{relative}:{line} imports {name}"
        for line, name in _imports(path)
        if name.startswith("trainer_ext.distributed.strategies.")
        # the plugins are accelerate's public config objects, which these files take as arguments
        and not (relative in SPEAKS_BACKEND_API and name.endswith((".plugin", ".config")))
    ]
    words = [
        f"{relative}:{number} reads {word!r}"
        for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        for word in BACKEND_WORDS
        if re.search(rf"\b{re.escape(word)}\b", text)
    ]
    assert backend_imports + words == []


def test_only_the_registry_names_the_strategies() -> None:
    """Outside distributed/strategies/ a strategy is reached through the registry (``STRATEGIES``,
    ``resolve_strategy``), never by its class's module: adding a strategy is one package and one registry entry."""
    classes = re.compile(r"trainer_ext\.distributed\.strategies\.(base|ddp|single|\w+\.strategy)")
    outside = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[:2] != ("distributed", "strategies")]
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
        for path in outside
        for line, name in _imports(path)
        if classes.fullmatch(name)
    ]
    assert bad == []


def _code_words(text: str) -> list[tuple[int, str]]:
    """(line, token) of every token of ``text`` but comments and docstrings: the code and its messages."""
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.add(first.lineno)
    return [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(text).readline)
        if token.type != tokenize.COMMENT and not (token.type == tokenize.STRING and token.start[0] in docstrings)
    ]


@pytest.mark.parametrize("relative", [r for r in GENERIC if r not in SPEAKS_BACKEND_API])
def test_generic_code_never_says_deepspeed(relative: str) -> None:
    """Outside comments and docstrings, generic code never names DeepSpeed (any case): its strategy says it."""
    path = PACKAGE / relative
    found = [
        f"{relative}:{line} says {word!r}"
        for line, word in _code_words(path.read_text(encoding="utf-8"))
        if re.search("deepspeed", word, re.IGNORECASE)
    ]
    assert found == []


# Import edges left in a cycle on purpose, each with why; remove one when its cycle is broken.
ALLOWED_CYCLE_EDGES = {
    # _compat's find_executable_batch_size router asks (lazily) whether the Trainer is ours, which shrinks its
    # micro-batch itself; auto_batch takes _compat's device-cache helpers. Breaking it needs a capability flag on
    # AutoBatchMixin for _compat to read instead.
    ("trainer_ext.trainer.compat", "trainer_ext.trainer.auto_batch"),
    # subpackages only (no module cycle): api runs estimate.startup's memory check (lazily) at startup, while
    # estimate.job/worker build and run the job through api
    ("trainer_ext.job", "trainer_ext.estimate"),
}


def _runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """The trainer_ext modules ``path`` imports at run time (top-level and in functions; not ``TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body
        for inner in ast.walk(statement)
    }
    own = _module_name(path)
    package = own.split(".") if path.name == "__init__.py" else own.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            # ``from pkg import mod`` depends on pkg.mod; ``from pkg import name`` on pkg (its __init__)
            found |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {name for name in found if name in modules and name != own}


def _import_graph(depth: int | None = None) -> dict[str, set[str]]:
    """Module -> the modules it imports; with ``depth``, names cut to that many parts (1: trainer_ext.X)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)

    def unit(name: str) -> str:
        return name if depth is None else ".".join(name.split(".")[: depth + 1])

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets = {unit(t) for t in _runtime_imports(path, modules)} - {unit(name)}
        graph.setdefault(unit(name), set()).update(t for t in targets if (unit(name), t) not in ALLOWED_CYCLE_EDGES)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.mark.parametrize("depth", [None, 1], ids=["modules", "subpackages"])
def test_no_import_cycles(depth: int | None) -> None:
    """No two modules (nor two subpackages/top-level modules) import each other, directly or around a loop,
    lazy imports included: only the commented edges of ALLOWED_CYCLE_EDGES."""
    assert _cycles(_import_graph(depth)) == []


def test_the_cycle_check_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_checks_see_a_violation() -> None:
    """The import reader resolves relative imports, lazy ones too: a leaf importing the engine is reported."""
    text = "def f():\n    from .distributed.engine import Engine\n    from . import saving\n"
    assert _imports_of(text, "trainer_ext.values", is_package=False) == [
        (2, "trainer_ext.distributed.engine"),
        (3, "trainer_ext.saving"),
    ]
    assert _imports_of("from ..state import X\n", "trainer_ext.distributed.strategies", is_package=True) == [
        (1, "trainer_ext.distributed.state")
    ]
