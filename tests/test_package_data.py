"""Every data file the package reads at run time is declared in setup.cfg, so a wheel install has it too."""

from __future__ import annotations

import configparser
import fnmatch
from pathlib import Path

from tests.helpers.paths import ROOT


def test_every_file_of_the_package_that_is_not_python_is_package_data() -> None:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg", encoding="utf-8")
    declared = {
        package: [p.strip() for p in patterns.split(",") if p.strip()]
        for package, patterns in parser["options.package_data"].items()
    }
    package_root = ROOT / "trainer_ext"
    missing = []
    for path in sorted(package_root.rglob("*")):
        if not path.is_file() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
            continue
        package = ".".join(Path("trainer_ext", *path.relative_to(package_root).parent.parts).parts)
        if not any(fnmatch.fnmatch(path.name, pattern) for pattern in declared.get(package, [])):
            missing.append(str(path.relative_to(ROOT)))
    assert missing == [], f"add them to [options.package_data] in setup.cfg: {missing}"
