"""``adapt``: any ``transformers.Trainer`` subclass (TRL's trainers, a user's own) on our engine.

The adapted class keeps its own arguments type: ``adapt(SFTTrainer)(args=SFTConfig(...))``. The arguments object is
re-based on our ``TrainingArguments`` behind the scenes (a dataclass that is both, every field kept), so the trainer's
``isinstance`` checks still hold and our device set-up replaces accelerate's.

Both classes carry our names, not the original's: the ones trainer_ext exports print and pickle as
``trainer_ext.<Name>``, any other as ``trainer_ext.trainer.adapt.<Name>`` (made at run time: instances pickle by
the original class instead, see ``_reduce_rebased``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import types
import typing
from typing import Any

import transformers

from trainer_ext.errors import ConfigError
from trainer_ext.trainer.trainer import Trainer
from trainer_ext.trainer.training_args import STOCK_TRAINING_ARGUMENTS as _STOCK_ARGUMENTS
from trainer_ext.trainer.training_args import TrainingArguments

# transformers' own Trainer, as our Trainer's base: `trainer-ext launch --swap_trainer` rebinds the public name
_STOCK_TRAINER: type = Trainer.__bases__[-1]
# transformers' classes whose adapted class trainer_ext exports under the same name (trainer/seq2seq.py)
_EXPORTED = ("Seq2SeqTrainer", "Seq2SeqTrainingArguments")


def _our_name(cls: type) -> tuple[str, str]:
    """``(__module__, __qualname__)`` for the class made from ``cls``: trainer_ext's public name where it exports one,
    else ``cls``'s name in this module."""
    for name in _EXPORTED:
        if cls is getattr(transformers, name):
            return "trainer_ext", name
    return __name__, cls.__name__


def _field_types(cls: type) -> dict[str, Any]:
    """``cls``'s field annotations resolved where ``cls`` is defined (the made class lives in another module)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation naming what is not importable here: kept as written
        return {}


@functools.cache
def rebased_arguments_class(cls: type) -> type:
    """A dataclass that is both ``cls`` and our ``TrainingArguments``: ``cls``'s fields with ``cls``'s defaults, plus
    ours; our ``__post_init__`` and device set-up come first in the method order and call ``cls``'s."""
    if issubclass(cls, TrainingArguments):
        return cls
    if not (isinstance(cls, type) and issubclass(cls, _STOCK_ARGUMENTS)):
        raise ConfigError(f"{cls!r} is not a transformers.TrainingArguments subclass")
    if cls is _STOCK_ARGUMENTS:
        return TrainingArguments
    module, name = _our_name(cls)
    namespace: dict[str, Any] = {
        "__module__": module,
        "__qualname__": name,
        "__doc__": cls.__doc__,
        "__annotations__": {},
        "_trainer_ext_rebased_from": cls,
        "__reduce_ex__": _reduce_rebased,
    }
    hints = _field_types(cls)
    for spec in dataclasses.fields(cls):  # cls's defaults win over the ones ours inherited from transformers
        namespace["__annotations__"][spec.name] = hints.get(spec.name, spec.type)
        namespace[spec.name] = copy.copy(spec)
    return dataclasses.dataclass(types.new_class(name, (TrainingArguments, cls), {}, lambda ns: ns.update(namespace)))


def _reduce_rebased(self: Any, protocol: int) -> tuple:
    """Pickle (training_args.bin) by the original class: the re-based one is made at run time, not importable."""
    return _unpickle_rebased, (type(self)._trainer_ext_rebased_from, self.__getstate__())


def _unpickle_rebased(cls: type, state: dict) -> Any:
    instance = object.__new__(rebased_arguments_class(cls))
    instance.__setstate__(state)
    return instance


def rebase_arguments(args: transformers.TrainingArguments) -> TrainingArguments:
    """``args`` as an instance of its re-based class, every init field's value kept (built anew: checks run again).

    A ``__post_init__`` that fills a field left ``None`` and then refuses to be given both (TRL's GRPOConfig:
    ``generation_batch_size`` and ``steps_per_generation``) is built again with that one field left to derive,
    and kept only when every field comes out as in ``args``."""
    if isinstance(args, TrainingArguments):
        return args
    cls = rebased_arguments_class(type(args))
    specs = [spec for spec in dataclasses.fields(args) if spec.init]
    values = {spec.name: getattr(args, spec.name) for spec in specs}
    try:
        return cls(**values)
    except ValueError as refused:
        derivable = [s.name for s in specs if s.default is None and values[s.name] is not None]
        for name in derivable:
            try:
                rebuilt = cls(**{**values, name: None})
            except ValueError:
                continue
            if all(_same(getattr(rebuilt, key), value) for key, value in values.items()):
                return rebuilt
        raise refused


def _same(left: Any, right: Any) -> bool:
    try:
        return bool(left == right)
    except Exception:  # values whose == is not a bool (arrays): compare what they print
        return repr(left) == repr(right)


def _arguments_type(trainer_cls: type) -> type | None:
    """The most derived TrainingArguments class named by ``trainer_cls.__init__``'s ``args`` annotation, if any."""
    try:
        parameter = inspect.signature(trainer_cls.__init__, eval_str=True).parameters.get("args")
    except Exception:  # an annotation naming what is not importable here
        return None
    if parameter is None or parameter.annotation is inspect.Parameter.empty:
        return None
    candidates = [
        t
        for t in (typing.get_args(parameter.annotation) or (parameter.annotation,))
        if isinstance(t, type) and issubclass(t, _STOCK_ARGUMENTS)
    ]
    candidates.sort(key=lambda t: len(t.__mro__), reverse=True)
    return candidates[0] if candidates else None


@functools.cache
def adapt(trainer_cls: type) -> type:
    """A subclass of ``trainer_cls`` that trains on trainer_ext's engine and takes ``trainer_cls``'s own arguments.

    ``adapt(SFTTrainer)(model=..., args=SFTConfig(...), train_dataset=...)`` runs TRL's SFT loop with our device
    placement, DDP/FSDP2/DeepSpeed, precision and checkpoints. Cached: the same class comes back for the same input.
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, _STOCK_TRAINER)):
        raise ConfigError(
            f"trainer_ext.adapt takes a transformers.Trainer subclass (e.g. trl.SFTTrainer), got {trainer_cls!r}"
        )
    if issubclass(trainer_cls, Trainer):
        return trainer_cls
    if trainer_cls is _STOCK_TRAINER:
        return Trainer
    base_init = trainer_cls.__init__
    signature = inspect.signature(base_init)
    default_args_type = _arguments_type(trainer_cls)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind_partial(self, *args, **kwargs)
        keywords = {name: value for name, value in bound.arguments.items() if name != "self"}
        for name, parameter in signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD and name in keywords:
                keywords.update(keywords.pop(name))
        arguments = keywords.get("args")
        if arguments is None and default_args_type is not None:
            # the trainer would build its own default; build it re-based (transformers' default output folder)
            arguments = rebased_arguments_class(default_args_type)(output_dir="tmp_trainer")
        if arguments is not None:
            keywords["args"] = rebase_arguments(arguments)
        Trainer.__init__(self, **keywords)

    module, name = _our_name(trainer_cls)
    namespace = {
        "__module__": module,
        "__qualname__": name,
        "__doc__": f"{trainer_cls.__name__} on trainer_ext's engine (trainer_ext.adapt).",
        "__init__": __init__,
        "_trainer_ext_adapted_from": trainer_cls,
    }
    __init__.__signature__ = signature  # type: ignore[attr-defined]  (help() and IDEs show the trainer's own)
    return types.new_class(name, (Trainer, trainer_cls), {}, lambda ns: ns.update(namespace))
