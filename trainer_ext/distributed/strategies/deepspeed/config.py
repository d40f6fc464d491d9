"""DeepSpeed JSON configs: load, validate, and fill ``"auto"`` values from the TrainingArguments.

Pure config logic (no deepspeed, no transformers at import time), so every rule is testable without
a process group. Resolution runs in two phases, as values become known:

1. :func:`resolve_auto` — from the TrainingArguments (batch sizes, accumulation, clipping, optimizer
   hyper-parameters, fp16/bf16), when the arguments are built;
2. :func:`finalize` — from the model and the schedule (hidden-size-derived ZeRO bucket sizes,
   scheduler total and warm-up steps), when training starts.

A value written in the JSON that contradicts the TrainingArguments is never overwritten: every such
key is reported in one :class:`~trainer_ext.errors.ConfigError`.
"""

from __future__ import annotations

import copy
import json
import math
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from trainer_ext.config_files import JSON, load_mapping, parse_mapping
from trainer_ext.errors import ConfigError

AUTO = "auto"
VALID_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
HIDDEN_SIZE_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)
_MISSING = object()


# -- loading and validation -----------------------------------------------------------------------
def load_deepspeed_config(source: str | os.PathLike | dict) -> dict:
    """Read a DeepSpeed JSON file (or deep-copy a dict) and validate it.

    Malformed JSON, a missing file and invalid settings raise :class:`ConfigError` naming the file.
    """
    if isinstance(source, dict):
        config = copy.deepcopy(source)
        validate_deepspeed_config(config)
        return config
    path = os.fspath(source)
    if path.lstrip().startswith("{"):  # the JSON itself, as transformers accepts for --deepspeed
        config = parse_mapping(path, "inline DeepSpeed JSON", fmt=JSON, unique_keys=True)
        validate_deepspeed_config(config)
        return config
    hint = "; pass a JSON file, e.g. --deepspeed configs/deepspeed/zero2.json"
    config = load_mapping(path, "DeepSpeed config", fmt=JSON, unique_keys=True, hint=hint)
    validate_deepspeed_config(config, source=path)
    return config


def _where(source: str | None) -> str:
    return f"DeepSpeed config {source}" if source else "the DeepSpeed config"


def _enabled(config: dict, section: str) -> Any:
    block = config.get(section)
    return block.get("enabled", False) if isinstance(block, dict) else False


def zero_stage(config: dict) -> int:
    """The ZeRO stage of ``config`` (0 when there is no ``zero_optimization`` block)."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return 0
    stage = zero.get("stage", 0)
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else -1


def validate_deepspeed_config(config: dict, source: str | None = None) -> None:
    """Reject settings DeepSpeed would fail on late or obscurely: stage, offload targets, fp16+bf16."""
    where = _where(source)
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f'{where}: zero_optimization must be an object, e.g. {{"stage": 2}}')
    stage = zero_stage(config)
    if stage not in VALID_STAGES:
        raise ConfigError(
            f"{where}: unknown ZeRO stage {zero.get('stage')!r} in zero_optimization.stage; "
            f"valid stages are {', '.join(map(str, VALID_STAGES))}"
        )
    for name in ("offload_param", "offload_optimizer"):
        block = zero.get(name)
        if block is None:
            continue
        key = f"zero_optimization.{name}"
        if not isinstance(block, dict):
            raise ConfigError(f'{where}: {key} must be an object, e.g. {{"device": "cpu"}}')
        device = block.get("device", "none")
        if device not in OFFLOAD_DEVICES:
            raise ConfigError(
                f"{where}: {key}.device={device!r} is not one of {', '.join(repr(d) for d in OFFLOAD_DEVICES)}"
            )
        if device == "nvme" and not block.get("nvme_path"):
            raise ConfigError(
                f"{where}: {key}.device is 'nvme' but no path is given; add "
                f'"nvme_path": "/path/to/local/nvme" to {key}'
            )
        if device != "none" and name == "offload_param" and stage != 3:
            raise ConfigError(f"{where}: {key} needs ZeRO stage 3 (this config has stage {stage}); use zero3_offload")
        if device != "none" and name == "offload_optimizer" and stage == 0:
            raise ConfigError(f"{where}: {key} needs ZeRO stage 1, 2 or 3 (this config has stage 0)")
    bf16 = _enabled(config, "bf16") is True or _enabled(config, "bfloat16") is True
    if _enabled(config, "fp16") is True and bf16:
        raise ConfigError(f"{where}: fp16.enabled and bf16.enabled are both true; enable at most one")


# -- dotted-key access ----------------------------------------------------------------------------
def _node(config: dict, dotted: str, create: bool = False) -> tuple[dict | None, str]:
    """The dict holding the last part of ``dotted`` (created on the way when ``create``), and that part."""
    *parents, leaf = dotted.split(".")
    node: Any = config
    for part in parents:
        child = node.get(part)
        if child is None and create:
            child = node[part] = {}
        if not isinstance(child, dict):
            return None, leaf
        node = child
    return node, leaf


def get_value(config: dict, dotted: str, default: Any = None) -> Any:
    """``config["a"]["b"]`` for ``"a.b"``; ``default`` when any part is missing."""
    node, leaf = _node(config, dotted)
    return default if node is None else node.get(leaf, default)


def auto_keys(config: Any, prefix: str = "") -> Iterator[str]:
    """Every dotted key whose value is still ``"auto"``."""
    if isinstance(config, dict):
        for key, value in config.items():
            yield from auto_keys(value, f"{prefix}{key}.")
    elif config == AUTO:
        yield prefix[:-1]


def check_resolved(config: dict) -> None:
    """Raise when some ``"auto"`` value is left (DeepSpeed would read the string as a number)."""
    left = sorted(auto_keys(config))
    if left:
        raise ConfigError(
            f"the DeepSpeed config still has 'auto' values for {', '.join(left)}; they are filled from the "
            "TrainingArguments (resolve_auto) and the model and schedule (finalize), or write a value instead"
        )


# -- "auto" resolution ----------------------------------------------------------------------------
@dataclass(frozen=True)
class DeepSpeedInputs:
    """What the TrainingArguments say about the values a DeepSpeed config may leave as ``"auto"``."""

    world_size: int = 1
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    max_grad_norm: float | None = 1.0
    learning_rate: float = 5e-5
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    weight_decay: float = 0.0
    fp16: bool = False
    bf16: bool = False
    # an optimizer/scheduler value written out in the config that differs from these: an error (the
    # TrainingArguments), or the config's to keep (a loop's optimizer, as accelerate fills only "auto")
    optimizer_must_match: bool = True

    @property
    def train_batch_size(self) -> int:
        """What DeepSpeed checks: world size x micro-batch x accumulation."""
        return self.world_size * self.micro_batch_size * self.gradient_accumulation_steps

    @classmethod
    def from_training_args(cls, args: Any, world_size: int | None = None) -> DeepSpeedInputs:
        """Read the fields from a ``TrainingArguments`` (``fp16_full_eval``/``bf16_full_eval`` count, as in HF)."""
        return cls(
            world_size=int(world_size if world_size is not None else getattr(args, "world_size", 1)),
            micro_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            max_grad_norm=args.max_grad_norm,
            learning_rate=args.learning_rate,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_epsilon=args.adam_epsilon,
            weight_decay=args.weight_decay,
            fp16=bool(args.fp16 or getattr(args, "fp16_full_eval", False)),
            bf16=bool(args.bf16 or getattr(args, "bf16_full_eval", False)),
        )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value) if isinstance(value, (str, list)) else str(value)


class _Filler:
    """Fills ``"auto"`` (and, where asked, missing) keys, collecting every contradiction before raising."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self.conflicts: list[str] = []

    def fill(self, dotted: str, value: Any, flag: str | None, *, if_missing: bool = False) -> None:
        """Set ``dotted`` to ``value`` where it is ``"auto"``; ``flag`` None means no check (not a user flag)."""
        node, leaf = _node(self.config, dotted, create=if_missing)
        if node is None:
            return
        current = node.get(leaf, _MISSING)
        if current == AUTO or (current is _MISSING and if_missing):
            node[leaf] = value
        elif current is not _MISSING and flag is not None and not _same(current, value):
            self.conflicts.append(f"{dotted}={_show(current)} in the DeepSpeed config but {flag}")

    def raise_conflicts(self, source: str | None) -> None:
        if self.conflicts:
            listing = "\n".join(f"  - {c}" for c in self.conflicts)
            raise ConfigError(
                f"{_where(source)} contradicts the TrainingArguments:\n{listing}\n"
                'Set these keys to "auto" (or remove them) to take the TrainingArguments values, or change the flags.'
            )


def resolve_auto(config: dict, inputs: DeepSpeedInputs, source: str | None = None) -> dict:
    """Phase 1: a copy of ``config`` with the TrainingArguments-derived ``"auto"`` values filled.

    Missing batch sizes, accumulation, clipping and fp16/bf16 switches are filled too. Explicit values
    that contradict ``inputs`` raise one ConfigError listing them all.
    """
    config = copy.deepcopy(config)
    validate_deepspeed_config(config, source)
    f = _Filler(config)
    micro, accum, world = inputs.micro_batch_size, inputs.gradient_accumulation_steps, inputs.world_size
    clip = float(inputs.max_grad_norm or 0.0)
    f.fill("train_micro_batch_size_per_gpu", micro, f"--per_device_train_batch_size={micro}", if_missing=True)
    f.fill("gradient_accumulation_steps", accum, f"--gradient_accumulation_steps={accum}", if_missing=True)
    f.fill(
        "train_batch_size",
        inputs.train_batch_size,
        f"world_size x --per_device_train_batch_size x --gradient_accumulation_steps = {world} x {micro} x {accum} "
        f"= {inputs.train_batch_size}",
        if_missing=True,
    )
    f.fill("gradient_clipping", clip, f"--max_grad_norm={inputs.max_grad_norm}", if_missing=True)
    lr = inputs.learning_rate
    checked = (lambda flag: flag) if inputs.optimizer_must_match else (lambda flag: None)
    f.fill("optimizer.params.lr", lr, checked(f"--learning_rate={lr}"))
    betas = [inputs.adam_beta1, inputs.adam_beta2]
    f.fill("optimizer.params.betas", betas, checked(f"--adam_beta1={betas[0]} --adam_beta2={betas[1]}"))
    f.fill("optimizer.params.eps", inputs.adam_epsilon, checked(f"--adam_epsilon={inputs.adam_epsilon}"))
    f.fill("optimizer.params.weight_decay", inputs.weight_decay, checked(f"--weight_decay={inputs.weight_decay}"))
    f.fill("scheduler.params.warmup_min_lr", 0, None)
    f.fill("scheduler.params.warmup_max_lr", lr, checked(f"--learning_rate={lr}"))
    for name, on in (("fp16", inputs.fp16), ("bf16", inputs.bf16)):
        # a block that exists without "enabled" gets it; a missing block only when the flag is on
        f.fill(f"{name}.enabled", on, f"--{name}={on}", if_missing=on or name in config)
    if "bfloat16" in config:  # DeepSpeed's older spelling of the bf16 block
        f.fill("bfloat16.enabled", inputs.bf16, f"--bf16={inputs.bf16}")
    f.raise_conflicts(source)
    validate_deepspeed_config(config, source)
    return config


def model_hidden_size(model: Any) -> int | None:
    """The hidden size a model's config declares (largest of ``hidden_sizes``; text config for multimodal)."""
    config = getattr(model, "config", None)
    for candidate in (config, getattr(config, "text_config", None)):
        if candidate is None:
            continue
        if isinstance(getattr(candidate, "hidden_size", None), int):
            return candidate.hidden_size
        sizes = getattr(candidate, "hidden_sizes", None)
        if sizes:
            return max(sizes)
    return None


def finalize(
    config: dict,
    hidden_size: int | None = None,
    num_training_steps: int | None = None,
    num_warmup_steps: int | None = None,
    source: str | None = None,
) -> dict:
    """Phase 2: a copy of ``config`` with the model- and schedule-derived ``"auto"`` values filled.

    Bucket sizes follow transformers: reduce = h², stage-3 prefetch = 0.9·h², persistence = 10·h.
    Afterwards no ``"auto"`` may remain; a key that still needs a missing input is named in the error.
    """
    config = copy.deepcopy(config)
    f = _Filler(config)
    if hidden_size is not None:
        f.fill("zero_optimization.reduce_bucket_size", hidden_size * hidden_size, None)
        f.fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size), None)
        f.fill("zero_optimization.stage3_param_persistence_threshold", 10 * hidden_size, None)
    if num_training_steps is not None:
        flag = f"num_training_steps={num_training_steps} (from --max_steps or epochs x steps per epoch)"
        f.fill("scheduler.params.total_num_steps", num_training_steps, flag)
    if num_warmup_steps is not None:
        # deepspeed>=0.19.6 rejects warmup_num_steps <= 0 (older versions clamped it)
        warmup = max(1, num_warmup_steps)
        f.fill("scheduler.params.warmup_num_steps", warmup, f"--warmup_steps/--warmup_ratio giving {warmup} steps")
    f.raise_conflicts(source)
    left = sorted(auto_keys(config))
    if left:
        needs = []
        for key in left:
            if key in HIDDEN_SIZE_KEYS:
                needs.append(f"{key} (needs the model's hidden_size: its config has none, write an integer)")
            elif key in ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps"):
                needs.append(f"{key} (needs the number of training/warm-up steps)")
            else:
                needs.append(f"{key} (not a value trainer_ext can derive; write it out)")
        raise ConfigError(f"{_where(source)}: cannot resolve 'auto' for " + "; ".join(needs))
    return config


# -- the object transformers expects ------------------------------------------------------------
class DeepSpeedConfig:
    """A DeepSpeed config with the query methods transformers calls on its ``HfDeepSpeedConfig``.

    Registered with :func:`register_with_transformers`, it makes ``is_deepspeed_zero3_enabled()`` and
    ``deepspeed_config()`` answer for our config, so ``from_pretrained`` builds ZeRO-3 models
    partitioned (``deepspeed.zero.Init``).
    """

    def __init__(self, config_or_source: str | os.PathLike | dict, source: str | None = None) -> None:
        self.config = load_deepspeed_config(config_or_source)
        self.source = source or (None if isinstance(config_or_source, dict) else os.fspath(config_or_source))
        self._transformers_view: _TransformersView | None = None  # set by register_with_transformers

    def __getstate__(self) -> dict:
        """Pickle and copy without the registration (a copy is not what transformers sees)."""
        return {**self.__dict__, "_transformers_view": None}

    # -- transformers' HfDeepSpeedConfig API
    def find_config_node(self, ds_key_long: str) -> tuple[dict | None, str]:
        return _node(self.config, ds_key_long)

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        return get_value(self.config, ds_key_long, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        node, leaf = _node(self.config, ds_key_long)
        if node is None or leaf not in node:
            if must_exist:
                raise ValueError(f"cannot delete {ds_key_long}: it is not in the DeepSpeed config")
            return
        del node[leaf]

    def is_true(self, ds_key_long: str) -> bool:
        """True when the key is set to a true value (``"auto"`` is still undecided: False)."""
        value = self.get_value(ds_key_long)
        return value is not None and value != AUTO and bool(value)

    def is_false(self, ds_key_long: str) -> bool:
        """True when the key is set to a false value (missing or ``"auto"``: False)."""
        value = self.get_value(ds_key_long)
        return value is not None and value != AUTO and not bool(value)

    def is_auto(self, ds_key_long: str) -> bool:
        return self.get_value(ds_key_long) == AUTO

    @property
    def stage(self) -> int:
        return zero_stage(self.config)

    def is_zero2(self) -> bool:
        return self.stage == 2

    def is_zero3(self) -> bool:
        return self.stage == 3

    def is_offload(self) -> bool:
        """True when ZeRO 1-3 offloads parameters or optimizer state to CPU or NVMe."""
        if self.stage not in (1, 2, 3):
            return False
        devices = {
            self.get_value("zero_optimization.offload_optimizer.device"),
            self.get_value("zero_optimization.offload_param.device"),
        }
        return bool(devices & {"cpu", "nvme"})

    def dtype(self) -> Any:
        """The training dtype: bf16, fp16 or fp32 (raises while fp16/bf16 are still ``"auto"``)."""
        import torch

        if self.is_auto("fp16.enabled") or self.is_auto("bf16.enabled"):
            raise ConfigError("fp16/bf16 are still 'auto' in the DeepSpeed config; call resolve() first")
        if self.is_true("bf16.enabled") or self.is_true("bfloat16.enabled"):
            return torch.bfloat16
        if self.is_true("fp16.enabled"):
            return torch.float16
        return torch.float32

    # -- our additions
    def resolve(self, inputs: DeepSpeedInputs) -> DeepSpeedConfig:
        """Phase 1 in place (see :func:`resolve_auto`); returns self. The dict stays the same object: whoever read
        ``config`` earlier (a loop's ``deepspeed_plugin.deepspeed_config``) sees the values filled."""
        self._replace(resolve_auto(self.config, inputs, self.source))
        return self

    def finalize(
        self,
        hidden_size: int | None = None,
        num_training_steps: int | None = None,
        num_warmup_steps: int | None = None,
    ) -> DeepSpeedConfig:
        """Phase 2 in place (see :func:`finalize`); returns self."""
        self._replace(finalize(self.config, hidden_size, num_training_steps, num_warmup_steps, self.source))
        return self

    def _replace(self, resolved: dict) -> None:
        self.config.clear()
        self.config.update(resolved)

    def __repr__(self) -> str:
        return f"DeepSpeedConfig(stage={self.stage}, offload={self.is_offload()}, source={self.source!r})"


class _TransformersView:
    """What transformers' ``is_deepspeed_zero3_enabled``/``deepspeed_config`` read: our config, plus a hook
    run on the first query that answers ZeRO-3, so DeepSpeed communication starts when transformers first
    needs it (``zero.Init`` in ``from_pretrained``), not when the arguments are built."""

    def __init__(self, config: DeepSpeedConfig, on_first_zero3_query: Callable[[], object] | None) -> None:
        self._config_ref = weakref.ref(config)  # the config holds this view; no cycle, so `del config` frees both
        self._hook = on_first_zero3_query

    @property
    def _config(self) -> DeepSpeedConfig:
        config = self._config_ref()
        if config is None:
            raise ReferenceError("the DeepSpeed config registered with transformers was freed")
        return config

    def is_zero3(self) -> bool:
        zero3 = self._config.is_zero3()
        if zero3 and self._hook is not None:
            self._hook()
            self._hook = None  # after it succeeded: a failed start is tried again at the next query
        return zero3

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not yet set (copy, pickle): no recursion through self._config
            raise AttributeError(name)
        return getattr(self._config, name)


def register_with_transformers(
    config: DeepSpeedConfig, on_first_zero3_query: Callable[[], object] | None = None
) -> None:
    """Make transformers see ``config`` (``is_deepspeed_zero3_enabled()``, ``from_pretrained`` under ZeRO-3).

    ``on_first_zero3_query`` runs once, the first time transformers asks whether ZeRO-3 is on and it is.
    transformers keeps only a weak reference; the registered view lives as long as ``config`` (the
    Trainer's arguments hold it). Its own ``HfDeepSpeedConfig`` needs accelerate (it subclasses
    accelerate's class and checks its version); ``set_hf_deepspeed_config`` does not, and it is all that
    ``is_deepspeed_zero3_enabled``/``deepspeed_config`` read, so we register our object directly.
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    config._transformers_view = _TransformersView(config, on_first_zero3_query)
    hf_deepspeed.set_hf_deepspeed_config(config._transformers_view)


def unregister_from_transformers() -> None:
    """Undo :func:`register_with_transformers` (transformers then sees no DeepSpeed config)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    hf_deepspeed.unset_hf_deepspeed_config()
