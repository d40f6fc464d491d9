"""Every ``pip install`` we show (README, docs, configs' READMEs, the package's hints) is a command that works.

trainer_ext is on no package index: its own install is the checkout form (``pip install -e ".[peft]"``), with extras
that setup.cfg defines; anything else named is a real package, pinned as the quick start and setup.cfg pin it.
"""

from __future__ import annotations

import ast
import configparser
import functools
import re
import shlex
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
PIP_INSTALL = re.compile(r"\bpip3? install\b")
OPERATOR = set("();<>|&")  # shell punctuation: a command ends there
VALUE_OPTIONS = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-t"}
CHECKOUT = re.compile(r"^\.(\[(?P<extras>[\w,-]+)\])?$")
PLACEHOLDER = "{?}"  # an f-string's interpolation: checked where its values are known (test_runtime_hints)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "configs").rglob("README.md"))]


def package_files() -> list[Path]:
    return sorted((ROOT / "trainer_ext").rglob("*.py"))


def markdown_code(text: str) -> list[str]:
    """The shell lines of fenced blocks (continuations joined) and every inline code span (which may wrap)."""
    code, prose, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            code.append(line)
        else:
            prose.append(line)
    snippets = "\n".join(code).replace("\\\n", " ").splitlines()
    return snippets + [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", "\n".join(prose))]


def python_strings(source: str) -> list[str]:
    """Every string literal of a module (adjacent literals joined, f-string interpolations as a placeholder)."""
    found, tree = [], ast.parse(source)
    parts = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts:
            found.append(node.value)
        elif isinstance(node, ast.JoinedStr):
            found.append(
                "".join(part.value if isinstance(part, ast.Constant) else PLACEHOLDER for part in node.values)
            )
    return [text for text in found if PIP_INSTALL.search(text)]


def pip_commands(text: str) -> list[list[str]]:
    """The words after each ``pip install`` in ``text``, up to a shell operator, a comment or a backtick."""
    commands = []
    for match in PIP_INSTALL.finditer(text):
        rest = text[match.end() :].split("`")[0]
        lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = []
        try:
            for word in lexer:
                if set(word) <= OPERATOR:
                    assert not set(word) & set("<>"), f"unquoted version specifier in {text!r}: quote it"
                    break
                words.append(word[:-1] if len(word) > 1 and word[-1] in ".,;:" else word)
        except ValueError as error:  # an unclosed quote
            raise AssertionError(f"cannot read the pip command in {text!r}: {error}") from None
        commands.append(words)
    return commands


@functools.cache
def all_commands() -> list[tuple[str, list[str]]]:
    """(where, words) for every pip install in the docs and the package's strings."""
    found = []
    for path in markdown_files():
        for snippet in markdown_code(path.read_text(encoding="utf-8")):
            found += [(str(path.relative_to(ROOT)), words) for words in pip_commands(snippet)]
    for path in package_files():
        for text in python_strings(path.read_text(encoding="utf-8")):
            found += [(str(path.relative_to(ROOT)), words) for words in pip_commands(text)]
    for path in sorted((ROOT / "scripts").glob("*.sh")):  # their comments tell how to install what they need
        for line in path.read_text(encoding="utf-8").splitlines():
            found += [(str(path.relative_to(ROOT)), words) for words in pip_commands(line.lstrip("# "))]
    return found


def split_arguments(words: list[str]) -> tuple[list[str], list[str]]:
    """(editable targets, requirements) of one ``pip install``'s words; other options are skipped."""
    editable, requirements, it = [], [], iter(words)
    for word in it:
        if word in ("-e", "--editable"):
            editable.append(next(it, ""))
        elif word.startswith("--editable="):
            editable.append(word.split("=", 1)[1])
        elif word in VALUE_OPTIONS:
            next(it, None)
        elif not word.startswith("-"):
            requirements.append(word)
    return editable, requirements


@functools.cache
def setup_cfg() -> tuple[dict[str, Requirement], dict[str, list[Requirement]]]:
    """setup.cfg's requirements by package name (install_requires and every extra), and the extras."""
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg", encoding="utf-8")
    extras = {
        name: [Requirement(line) for line in value.split("\n") if line.strip()]
        for name, value in parser["options.extras_require"].items()
    }
    base = [Requirement(line) for line in parser["options"]["install_requires"].split("\n") if line.strip()]
    pinned = {canonicalize_name(req.name): req for reqs in [base, *extras.values()] for req in reqs if req.specifier}
    return pinned, extras


def quick_start_torch() -> str:
    """The torch version README.md's quick start pins (the line CI runs verbatim)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    line = re.search(r"^pip install torch==([0-9.]+) && .*python -m pytest -q$", readme, re.MULTILINE)
    assert line, "README.md has no install-and-test command line"
    return line.group(1)


def third_party(where: str, requirement: str) -> Requirement:
    """A requirement on another package, checked against the pins it must agree with."""
    from trainer_ext.trainer.compat import TESTED_TRANSFORMERS

    try:
        req = Requirement(requirement)
    except InvalidRequirement as error:
        raise AssertionError(f"{where}: {requirement!r} is not a requirement pip can read ({error})") from None
    name = canonicalize_name(req.name)
    assert name != "trainer-ext", f"{where}: {requirement!r} installs from a package index; use pip install -e '.[x]'"
    if name == "torch":
        assert str(req.specifier) in ("", f"=={quick_start_torch()}"), f"{where}: {requirement!r} != the quick start"
    elif name == "transformers":
        assert req.specifier.contains(TESTED_TRANSFORMERS[0]) or not req.specifier, f"{where}: {requirement!r}"
    elif name in (pinned := setup_cfg()[0]) and req.specifier:
        assert req.specifier == pinned[name].specifier, f"{where}: {requirement!r}, setup.cfg says {pinned[name]}"
    return req


def check_command(where: str, words: list[str]) -> list[Requirement]:
    """Assert one pip install is a checkout install with known extras and/or real requirements; returns the latter.

    A command of options only (``pip install --no-compile``, named in prose) passes."""
    extras = setup_cfg()[1]
    editable, requirements = split_arguments(words)
    for target in editable:
        match = CHECKOUT.match(target)
        assert match, f"{where}: -e {target!r}: the checkout form is -e . or -e '.[extra,...]'"
        unknown = set((match.group("extras") or "").split(",")) - set(extras) - {""}
        assert not unknown, f"{where}: extras {sorted(unknown)} are not in setup.cfg's extras_require"
    found = []
    for requirement in requirements:
        if PLACEHOLDER in requirement:
            continue
        assert not CHECKOUT.match(requirement) and not requirement.startswith(("/", "./")), (
            f"{where}: {requirement!r}: the project's own install is editable, pip install -e ..."
        )
        found.append(third_party(where, requirement))
    return found


def test_commands_are_found_where_expected() -> None:
    """The extraction sees the commands we know of: the quick start, the peft extra, a package hint."""
    found = {(where, " ".join(words)) for where, words in all_commands()}
    assert ("README.md", f"torch=={quick_start_torch()}") in found
    assert ("README.md", "-e .[peft]") in found
    assert ("trainer_ext/job/lora_arguments.py", "peft>=0.14") in found


@pytest.mark.parametrize("path", markdown_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_pip_install_in_the_docs_is_in_code(path: Path) -> None:
    """A command split by prose would escape the checks below: each one sits in a code span or block."""
    text = path.read_text(encoding="utf-8")
    in_code = sum(len(PIP_INSTALL.findall(snippet)) for snippet in markdown_code(text))
    assert in_code == len(PIP_INSTALL.findall(re.sub(r"\s+", " ", text))), path


def test_every_install_command_works_from_a_checkout() -> None:
    for where, words in all_commands():
        check_command(where, words)


def test_readme_lists_every_extra() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    listed = readme.split("\nExtras", 1)[1].split("\n\n", 1)[0]
    for extra in setup_cfg()[1]:
        assert f"`{extra}`" in listed, f"README.md's Extras line does not list {extra!r}"


def runtime_hints() -> list[str]:
    """Hints assembled at run time: the transformers refusal and warning, each tracker's missing-package error."""
    from trainer_ext.errors import ConfigError
    from trainer_ext.trackers import TRACKERS
    from trainer_ext.trainer import compat as _compat

    hints = []
    with pytest.raises(ImportError) as refused:
        _compat.check_transformers_version("5.16.0")
    hints.append(str(refused.value))
    with warnings.catch_warnings(record=True) as caught, pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("always")
        patch.setattr(_compat, "_warned_newer", False)
        _compat.check_transformers_version("99.0.0")
    hints += [str(warning.message) for warning in caught]
    for tracker in TRACKERS.values():
        with pytest.MonkeyPatch.context() as patch, pytest.raises(ConfigError) as missing:
            patch.setattr(tracker, "available", classmethod(lambda cls: False))
            tracker.check_installed()
        hints.append(str(missing.value))
    return hints


def test_runtime_hints() -> None:
    for hint in runtime_hints():
        commands = pip_commands(hint)
        assert commands, hint
        for words in commands:
            check_command(f"hint {hint!r}", words)


def _versions(name: str) -> list[Version] | None:
    """The released versions pip's index lists for ``name`` (None when it cannot say)."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", name, "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    listed = re.search(r"^Available versions: (.*)$", done.stdout, re.MULTILINE)
    if done.returncode or not listed:
        return None
    versions = []
    for word in listed.group(1).split(", "):
        try:
            versions.append(Version(word))
        except InvalidVersion:
            pass
    return versions


def test_every_package_named_is_on_the_index() -> None:
    """The real check: each package a command names exists there, in a version its specifier admits."""
    requirements: dict[str, Requirement] = {}
    hints = [words for _, words in all_commands()] + [
        words for hint in runtime_hints() for words in pip_commands(hint)
    ]
    for words in hints:
        for req in check_command("", words):
            requirements[f"{canonicalize_name(req.name)}{req.specifier}"] = req
    names = sorted({canonicalize_name(req.name) for req in requirements.values()})
    with ThreadPoolExecutor(max_workers=4) as pool:
        listed = dict(zip(names, pool.map(_versions, names), strict=True))
    if listed.get("torch") is None:
        pytest.skip("no package index answers here (pip index versions torch failed)")
    for key, req in sorted(requirements.items()):
        versions = listed[canonicalize_name(req.name)]
        assert versions, f"{req.name} is not on the package index"
        assert any(req.specifier.contains(v, prereleases=True) for v in versions), f"no release of {key} exists"
