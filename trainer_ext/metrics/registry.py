"""Metric names to implementations, per task: ``load(name)`` never touches the network for a name of ours.

The names are those of ``evaluate``'s hub metrics. A name that is not ours may still be an ``evaluate`` module already
on this machine (a local script or folder, or one in evaluate's module cache); only then is ``evaluate`` used.
"""

from __future__ import annotations

import inspect
import os
import re
import stat
from pathlib import Path
from typing import Any

from trainer_ext.errors import ConfigError, did_you_mean
from trainer_ext.metrics.base import Metric
from trainer_ext.metrics.classification import F1, Accuracy, MatthewsCorrelation, Precision, Recall
from trainer_ext.metrics.language_modeling import Perplexity, TokenAccuracy

CLASSIFICATION = "sequence-classification"
CAUSAL_LM = "causal-lm"
# per task, the metric a name means there ("accuracy" is per example for a classifier, per next token for an LM)
TASK_METRICS: dict[str, dict[str, type[Metric]]] = {
    CLASSIFICATION: {
        "accuracy": Accuracy,
        "f1": F1,
        "precision": Precision,
        "recall": Recall,
        "matthews_correlation": MatthewsCorrelation,
    },
    CAUSAL_LM: {"perplexity": Perplexity, "accuracy": TokenAccuracy},
}
# what a name means without a task: the classification metric, except the names only an LM has
DEFAULT_METRICS: dict[str, type[Metric]] = {
    **TASK_METRICS[CAUSAL_LM],
    **TASK_METRICS[CLASSIFICATION],
    "token_accuracy": TokenAccuracy,
}
NAMES = tuple(sorted(DEFAULT_METRICS))


def normalize_name(name: str) -> str:
    """``Matthews-Correlation`` → ``matthews_correlation``."""
    return name.strip().lower().replace("-", "_")


def metric_class(name: str, task: str | None = None) -> type[Metric]:
    """The class behind a name of ours (for ``task`` if given); ConfigError for an unknown or unfitting name."""
    key = normalize_name(name)
    if task is None:
        if key in DEFAULT_METRICS:
            return DEFAULT_METRICS[key]
        raise ConfigError(f"unknown metric {name!r}; known metrics: {', '.join(NAMES)}.{did_you_mean(key, NAMES)}")
    if task not in TASK_METRICS:
        raise ConfigError(f"unknown task {task!r} for metrics; choose one of {', '.join(TASK_METRICS)}")
    table = TASK_METRICS[task]
    if key == "token_accuracy" and task == CAUSAL_LM:
        return TokenAccuracy
    if key in table:
        return table[key]
    if key in NAMES:
        fits = sorted(
            t for t, names in TASK_METRICS.items() if key in names or key == "token_accuracy" and t == CAUSAL_LM
        )
        raise ConfigError(
            f"metric {name!r} does not fit --task {task} (it is for {', '.join(fits)}); metrics for {task}: "
            f"{', '.join(table)}"
        )
    raise ConfigError(
        f"unknown metric {name!r}; metrics for {task}: {', '.join(table)}.{did_you_mean(key, list(table))}"
    )


def load(name: str, task: str | None = None, **options: Any) -> Any:
    """A metric object with ``add_batch`` and ``compute``, like ``evaluate.load(name)``; options go to its constructor.

    Our names (``NAMES``) never import ``evaluate`` nor make a network call. Any other name must be an ``evaluate``
    module already here (a script path, or a hub metric in evaluate's cache), else ConfigError listing ours.
    """
    if not isinstance(name, str):
        raise ConfigError(f"a metric name must be a string such as 'accuracy', not {type(name).__name__} {name!r}")
    if task is not None and not isinstance(task, str):
        raise ConfigError(f"task must be one of {', '.join(TASK_METRICS)}, not {type(task).__name__} {task!r}")
    key = normalize_name(name)
    if key in NAMES or task is not None:
        cls = metric_class(name, task)
        accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise ConfigError(
                f"metric {name!r} takes no option {', '.join(unknown)}; its options: {', '.join(sorted(accepted))}"
            )
        try:
            return cls(**options)
        except (ValueError, TypeError) as error:
            raise ConfigError(f"metric {name!r}: {error}") from error
    local = local_evaluate_module(name)
    if local is None:
        raise ConfigError(
            f"unknown metric {name!r}; known metrics: {', '.join(NAMES)}.{did_you_mean(key, NAMES)} (an evaluate "
            f"module is used only when it is already on this machine: {SCRIPT_RULE})"
        )
    import evaluate

    return evaluate.load(str(local), **options)


SCRIPT_RULE = "give the path of its script NAME.py, or of a folder NAME holding NAME.py"
# a bare name looked up in evaluate's module cache: what a hub metric may be called, nothing that globs or climbs
CACHE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def local_evaluate_module(name: str) -> Path | None:
    """The local ``evaluate`` script for ``name``, or None: a ``.py`` file, a folder ``X`` holding ``X.py``, or the
    newest copy of a hub metric in evaluate's module cache. Only these does ``evaluate.load`` read without a network
    look-up, so nothing else is ever handed to it; a path that exists but is neither is a ConfigError."""
    if not name.strip():
        return None
    path = Path(os.path.expanduser(name))
    script = path if path.suffix == ".py" else path / f"{path.name}.py"
    if path.name and _is_regular_file(script):
        return script
    if _exists(path):
        kind = (
            ("a folder" if path.name in ("", "..") else f"a folder without {script.name} in it")
            if path.is_dir()
            else "not a regular file"
            if path.suffix == ".py"
            else "not a .py script"
        )
        raise ConfigError(
            f"metric {name!r} is not one of ours ({', '.join(NAMES)}) and {path} is {kind}; evaluate loads a local "
            f"module offline only from a script: {SCRIPT_RULE}"
        )
    if "/" in name or os.sep in name or len(name) > 200 or not CACHE_NAME.fullmatch(name):
        return None
    try:
        import evaluate.config
    except ImportError:
        return None
    cached = Path(evaluate.config.HF_MODULES_CACHE) / "evaluate_modules" / "metrics" / f"evaluate-metric--{name}"
    scripts = sorted((p for p in cached.glob(f"*/{name}.py") if _is_regular_file(p)), key=lambda p: p.stat().st_mtime)
    return scripts[-1] if scripts else None


def _exists(path: Path) -> bool:
    """Whether anything (a link included) is at ``path``; a name the file system refuses is nothing there."""
    try:
        os.lstat(path)
    except (OSError, ValueError):
        return False
    return True


def _is_regular_file(path: Path) -> bool:
    """Whether ``path`` is (or links to) a regular file; never opens it, so a FIFO cannot hang us."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False
