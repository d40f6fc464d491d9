"""The docs stay true to the code and stay reference pages.

docs/design.md: every repository path and ``trainer_ext.*`` module it names exists, every name its "Where to find
it" table gives is defined in the files of the same row, and its picture is what ``docs/layers.py`` draws.
docs/*.md: no commit hashes and no dated log lines (measured runs live in benchmarks/results/).
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import re
import runpy
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DESIGN = DOCS / "design.md"
TOP_FOLDERS = ("trainer_ext", "tests", "docs", "benchmarks", "configs", "scripts", "examples")
PATH_SUFFIXES = (".py", ".md", ".json", ".jsonl", ".yaml", ".yml", ".svg", ".png", ".html", ".sh")


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def _looks_like_path(span: str) -> bool:
    return re.fullmatch(r"[\w.…/-]+", span) is not None and ("/" in span or span.endswith(PATH_SUFFIXES))


@cache
def _repository_files() -> tuple[str, ...]:
    """Every file and folder of the repository, as relative POSIX paths (folders end in '/')."""
    found = []
    for folder in TOP_FOLDERS:
        for path in (ROOT / folder).rglob("*"):
            if "__pycache__" in path.parts:
                continue
            relative = path.relative_to(ROOT).as_posix()
            found.append(relative + "/" if path.is_dir() else relative)
    return tuple(found)


def _resolve(span: str) -> list[str]:
    """Repository paths ``span`` may name: itself from the root, or (written inside a package's paragraph, such as
    ``fsdp/strategy.py`` or ``commit.py``) the end of a path under trainer_ext/."""
    name = span.lstrip("…/").rstrip(".")
    if (ROOT / name).exists():
        return [name]
    if name.split("/")[0] in TOP_FOLDERS:
        return []  # written from the root: it must exist from the root
    wanted = name if name.endswith("/") or "." in name.rsplit("/", 1)[-1] else name + "/"
    return [p for p in _repository_files() if p.startswith("trainer_ext/") and p.endswith("/" + wanted)]


def test_every_path_design_names_exists() -> None:
    text = DESIGN.read_text(encoding="utf-8")
    spans = [s for s in _code_spans(text) if _looks_like_path(s)]
    links = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t and not t.startswith("#")]
    assert len(spans) > 50, "design.md names the files of each layer; the extraction found too few"
    missing = [s for s in spans if not _resolve(s)]
    missing += [f"link {t}" for t in links if not (DOCS / t).exists()]
    assert missing == []


SUBPACKAGES = tuple(
    sorted(p.stem if p.is_file() else p.name for p in (ROOT / "trainer_ext").iterdir() if p.suffix in ("", ".py"))
)


def _dotted_names(text: str) -> list[str]:
    """``trainer_ext.a.b`` names, and ``a.b`` ones that start with one of its packages (``checkpointing.marker``)."""
    own = "|".join(re.escape(name) for name in SUBPACKAGES if name.isidentifier())
    pattern = rf"(?<![\w.])(trainer_ext|{own})((?:\.\w+)+)"
    found = set()
    for span in _code_spans(text):
        if _looks_like_path(span):
            continue
        for first, rest in re.findall(pattern, span):
            found.add(first + rest if first == "trainer_ext" else f"trainer_ext.{first}{rest}")
    return sorted(found)


def _find_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:  # a parent is a module, not a package
        return None


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    if path.name == "__init__.py":  # lazily exported names: the keys of the module's name -> module tables
        text = path.read_text(encoding="utf-8")
        names |= set(re.findall(r'^\s+"(\w+)": "trainer_ext[\w.]*",?$', text, re.MULTILINE))
    return names


def test_every_trainer_ext_module_design_names_imports() -> None:
    """``trainer_ext.a.b`` is a module (found by importlib) or a name its longest module prefix defines."""
    names = _dotted_names(DESIGN.read_text(encoding="utf-8"))
    assert names, "design.md names trainer_ext modules; the extraction found none"
    bad = []
    for dotted in names:
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            spec = _find_spec(".".join(parts[:cut]))
            if spec is not None:
                break
        rest = parts[cut:]
        if rest and (spec is None or spec.origin is None or rest[0] not in _top_level_names(Path(spec.origin))):
            bad.append(dotted)
    assert bad == []


def _where_rows() -> list[str]:
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("## Where to find it", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| question")]


def _defined_names(path: Path) -> set[str]:
    """Classes, functions, methods, assigned names and attributes, and imported names of a module."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.id if isinstance(node, ast.Name) else node.attr)
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return names


@pytest.mark.parametrize("row", _where_rows(), ids=lambda row: row.split("|")[1].strip()[:40])
def test_where_to_find_it_names_what_its_files_define(row: str) -> None:
    """Each answer is one hop: the functions and classes it names are defined in the files it names."""
    question, answer = row.strip("|").split("|", 1)
    spans = _code_spans(answer)
    files = [ROOT / p for s in spans if _looks_like_path(s) for p in _resolve(s) if p.endswith(".py")]
    assert files or "/" in answer, f"{question.strip()}: the answer names no file"
    defined = set().union(*(_defined_names(f) for f in files)) if files else set()
    identifiers = [s for s in spans if not _looks_like_path(s) and re.fullmatch(r"[A-Za-z_][\w.]*", s)]
    missing = [s for s in identifiers if s.rsplit(".", 1)[-1] not in defined]
    assert missing == [], f"{question.strip()}: not defined in {[f.relative_to(ROOT).as_posix() for f in files]}"


def test_the_strategy_contract_table_names_what_the_base_class_defines() -> None:
    text = DESIGN.read_text(encoding="utf-8")
    table = text.split("| concern | what a strategy answers |", 1)[1].split("\n\n", 1)[0]
    named = {s for s in _code_spans(table) if s.isidentifier()}
    base = ast.parse((ROOT / "trainer_ext/distributed/strategies/base.py").read_text(encoding="utf-8"))
    strategy = next(n for n in base.body if isinstance(n, ast.ClassDef) and n.name == "Strategy")
    defined = {n.name for n in strategy.body if isinstance(n, ast.FunctionDef)}
    defined |= {t.id for n in strategy.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assert len(named) > 20
    assert sorted(named - defined) == []


def test_the_layer_picture_is_what_its_source_draws() -> None:
    draw = runpy.run_path(str(DOCS / "layers.py"))
    assert (DOCS / "layers.svg").read_text(encoding="utf-8") == draw["render"](), "run: python docs/layers.py"


# A benchmarks/results file is named by its date; everywhere else a date or a commit is a log line.
RESULT_FILE = re.compile(r"(?:\.\./)?(?:benchmarks/results/)?[\w.-]*\d{4}-\d\d-\d\d[\w.-]*\.(?:md|json)")
DATE = re.compile(
    r"\b20\d\d-[01]\d-[0-3]\d\b|\b\d{1,2} (?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)\w* 20\d\d\b"
)
HASH_IN_CODE = re.compile(r"`(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}`")
HASH_AFTER_WORD = re.compile(r"\b(?:commit|commits|at|since|before|after)\s+`?[0-9a-f]{7,40}\b", re.IGNORECASE)
LOG_PHRASES = re.compile(
    r"\b(?:(?:a|the) day later|(?:later|earlier) (?:the|that) same day|(?:a|the) (?:second|third|fourth) day|"
    r"(?:an? |the )?(?:earlier|previous|last) session|this session|yesterday|tried and dropped|"
    r"(?:on|a) (?:quiet|noisy|slower|faster) day)\b",
    re.IGNORECASE,
)


def _log_lines(text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        plain = RESULT_FILE.sub("", line)
        for pattern in (DATE, HASH_IN_CODE, HASH_AFTER_WORD, LOG_PHRASES):
            found += [f"{number}: {m.group(0)!r}" for m in pattern.finditer(plain)]
    return found


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_docs_hold_no_commit_hashes_or_dated_log_lines(page: str) -> None:
    """Reference pages say how things work; runs, dates and commits belong in benchmarks/results/ and git log."""
    assert _log_lines((DOCS / page).read_text(encoding="utf-8")) == []


@pytest.mark.parametrize(
    "line",
    [
        "A whole run took 25.6 minutes (2026-11-25, commit e2ecad4).",
        "The next whole run, at 1278dde, took 30.1 minutes.",
        "before (`d2fc6b2`) and after",
        "A day later, on a noisier machine, the ratios were",
        "Tried and dropped: pip install --no-compile.",
        "The previous session measured 5.9 s.",
    ],
)
def test_the_log_check_catches_what_the_pages_used_to_hold(line: str) -> None:
    assert _log_lines(line) != []


@pytest.mark.parametrize(
    "line",
    [
        "from [`run_2026-11-24_quiet.md`](../benchmarks/results/run_2026-11-24_quiet.md):",
        "`--num_processes` at most 1048576, `--max_seq_length` 2…1048576",
        "a SHA-256 checksum per file, `COMPLETE` written last",
    ],
)
def test_the_log_check_leaves_reference_text_alone(line: str) -> None:
    assert _log_lines(line) == []
