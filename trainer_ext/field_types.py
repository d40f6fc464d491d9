"""Check every field of a job's arguments against its annotated type before anything starts.

A config file can hold any YAML: ``learning_rate: {a: 1}``, ``per_device_train_batch_size: [4, 8]``,
``task: [causal-lm]``. The flag parser converts scalars but passes lists and mappings through, and the dataclass
stores whatever it is given, so without this check the wrong shape surfaces as a traceback deep in training. Here
it is one ConfigError naming the field, what it holds and what it takes.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from typing import Any

from trainer_ext.errors import ConfigError

_NONE = type(None)


def _fits(value: Any, annotation: Any) -> bool:
    """Whether ``value`` has the shape ``annotation`` describes (unknown annotations accept anything)."""
    if annotation is Any or annotation is object:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arm) for arm in typing.get_args(annotation))
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is _NONE:
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return isinstance(value, (annotation, str))
    container = origin or annotation
    if container in (list, tuple, set, typing.List, typing.Tuple):  # noqa: UP006 - old spellings in transformers
        if not isinstance(value, (list, tuple)):
            return False
        args = [arg for arg in typing.get_args(annotation) if arg is not Ellipsis]
        return not args or all(_fits(item, args[0]) for item in value)
    if container in (dict, typing.Dict) or (isinstance(container, type) and issubclass(container, dict)):  # noqa: UP006
        return isinstance(value, dict)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def _describe(annotation: Any) -> str:
    """``float``, ``str or None``, ``list of str`` … as a user reads it."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        arms = [arm for arm in typing.get_args(annotation) if arm is not _NONE]
        words = " or ".join(dict.fromkeys(_describe(arm) for arm in arms))
        return words + (" (or none)" if len(arms) < len(typing.get_args(annotation)) else "")
    if origin in (list, tuple) or annotation in (list, tuple):
        args = typing.get_args(annotation)
        return f"a list of {_describe(args[0]).removeprefix('a ')}s" if args else "a list"
    if origin is dict or annotation is dict:
        return "a mapping"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        names = [str(member.value) for member in annotation]
        return "a name: " + ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")
    return {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_field_types(obj: Any, also: dict[str, tuple[type, ...]] | None = None) -> None:
    """ConfigError for the first field of dataclass ``obj`` whose value does not have its annotated type.

    ``also`` names further types a field takes (where a library accepts more than its annotation says). Also
    refuses a float field holding NaN or infinity: no setting of a training job means either.
    """
    hints = typing.get_type_hints(type(obj))
    extra = also or {}
    for field in dataclasses.fields(obj):
        annotation = hints.get(field.name, Any)
        value = getattr(obj, field.name)
        if not _fits(value, annotation) and not isinstance(value, extra.get(field.name, ())):
            raise ConfigError(
                f"{field.name}: got {_shown(value)} ({type(value).__name__}), but it takes {_describe(annotation)}"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{field.name}: got {value}, but it takes a finite number")
