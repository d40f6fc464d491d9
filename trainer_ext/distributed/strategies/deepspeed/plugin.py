"""accelerate's DeepSpeed objects for hand-written loops: ``DeepSpeedPlugin``, ``DummyOptim``, ``DummyScheduler``.

A loop written for accelerate configures DeepSpeed with a ``DeepSpeedPlugin`` (a JSON file or a few fields) and,
when that config has its own ``optimizer``/``scheduler`` blocks, passes placeholders to ``prepare`` so that
DeepSpeed builds them. These classes take the same arguments and mean the same; the Accelerator and the engine
turn them into a ``deepspeed.initialize`` call.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from trainer_ext.distributed.optimizer import OptimizerPlaceholder, SchedulerPlaceholder
from trainer_ext.distributed.strategies.deepspeed.config import AUTO, DeepSpeedConfig
from trainer_ext.errors import ConfigError

# the plugin's fields and the config keys they stand for
_FIELD_KEYS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}


@dataclass
class DeepSpeedPlugin:
    """DeepSpeed settings for ``Accelerator(deepspeed_plugin=...)``, with accelerate's fields and defaults.

    ``hf_ds_config`` (a JSON path or a dict) is the whole config; the other fields fill its ``"auto"`` values
    and are read back from it. Without it, the fields make the config (ZeRO-2, no offload by default).
    ``deepspeed_config`` is the live dict: ``prepare`` fills its remaining ``"auto"`` values.
    """

    hf_ds_config: Any = field(default=None, metadata={"help": "DeepSpeed config: a JSON file path or a dict."})
    gradient_accumulation_steps: int | str | None = field(
        default=None, metadata={"help": "Micro-batches per optimizer step ('auto': the Accelerator's)."}
    )
    gradient_clipping: float | str | None = field(default=None, metadata={"help": "Clip the gradient norm to this."})
    zero_stage: int | None = field(default=None, metadata={"help": "ZeRO stage 0, 1, 2 or 3 (default 2)."})
    is_train_batch_min: bool = field(
        default=True, metadata={"help": "Several training loaders: the smallest batch size sets the micro-batch."}
    )
    offload_optimizer_device: str | None = field(default=None, metadata={"help": "none, cpu or nvme (ZeRO 2-3)."})
    offload_param_device: str | None = field(default=None, metadata={"help": "none, cpu or nvme (ZeRO-3)."})
    offload_optimizer_nvme_path: str | None = field(default=None, metadata={"help": "Where nvme offload writes."})
    offload_param_nvme_path: str | None = field(default=None, metadata={"help": "Where nvme offload writes."})
    zero3_init_flag: bool | None = field(
        default=None, metadata={"help": "Build transformers models partitioned (ZeRO-3 only; default: on for ZeRO-3)."}
    )
    zero3_save_16bit_model: bool | None = field(
        default=None, metadata={"help": "Gather the 16-bit weights when saving a ZeRO-3 model."}
    )
    transformer_moe_cls_names: str | None = field(default=None, metadata={"help": "Not supported by trainer_ext."})
    enable_msamp: bool | None = field(default=None, metadata={"help": "MS-AMP fp8: not supported by trainer_ext."})
    msamp_opt_level: str | None = field(default=None, metadata={"help": "MS-AMP level: not supported."})

    def __post_init__(self) -> None:
        if self.enable_msamp or self.transformer_moe_cls_names:
            raise ConfigError(
                "DeepSpeedPlugin: enable_msamp and transformer_moe_cls_names are accelerate features trainer_ext does "
                "not have; leave them unset"
            )
        if self.gradient_accumulation_steps is None:
            self.gradient_accumulation_steps = AUTO
        if self.gradient_clipping is None:
            self.gradient_clipping = AUTO
        self.offload_optimizer_device = self.offload_optimizer_device or "none"
        self.offload_param_device = self.offload_param_device or "none"
        self.offload_optimizer_nvme_path = self.offload_optimizer_nvme_path or "none"
        self.offload_param_nvme_path = self.offload_param_nvme_path or "none"
        self.zero3_save_16bit_model = bool(self.zero3_save_16bit_model)
        given = self.hf_ds_config
        if isinstance(given, DeepSpeedConfig):
            self.hf_ds_config = given
        elif isinstance(given, dict | str | os.PathLike):
            self.hf_ds_config = DeepSpeedConfig(given)
        elif given is None:
            self.hf_ds_config = DeepSpeedConfig(self._config_from_fields())
        else:
            raise ConfigError(
                f"DeepSpeedPlugin(hf_ds_config=...) takes a JSON path or a dict, got {type(given).__name__}"
            )
        config = self.hf_ds_config.config
        if given is not None:
            config.setdefault("gradient_accumulation_steps", 1)
            if "zero_optimization" not in config:
                raise ConfigError("Please specify the ZeRO optimization config in the DeepSpeed config.")
            self._fill_autos_from_fields()
        if self.zero3_init_flag is None:
            self.zero3_init_flag = self.hf_ds_config.is_zero3()
        elif self.zero3_init_flag and not self.hf_ds_config.is_zero3():
            self.zero3_init_flag = False  # accelerate warns and turns it off: it only applies to ZeRO-3
        config["steps_per_print"] = float("inf")  # DeepSpeed's own stdout logging off, as in accelerate

    def _config_from_fields(self) -> dict[str, Any]:
        stage = 2 if self.zero_stage is None else self.zero_stage
        config: dict[str, Any] = {
            "train_batch_size": AUTO,
            "train_micro_batch_size_per_gpu": AUTO,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "zero_optimization": {
                "stage": stage,
                "offload_optimizer": {"device": self.offload_optimizer_device},
                "offload_param": {"device": self.offload_param_device},
                "stage3_gather_16bit_weights_on_model_save": self.zero3_save_16bit_model,
            },
        }
        for kind in ("optimizer", "param"):
            if getattr(self, f"offload_{kind}_device") == "nvme":
                config["zero_optimization"][f"offload_{kind}"]["nvme_path"] = getattr(
                    self, f"offload_{kind}_nvme_path"
                )
        if self.gradient_clipping:
            config["gradient_clipping"] = self.gradient_clipping
        self.zero_stage = stage
        return config

    def _fill_autos_from_fields(self) -> None:
        """A field set on the plugin fills the config's ``"auto"`` for it; then every field reads the config."""
        for name, key in _FIELD_KEYS.items():
            value = getattr(self, name)
            node, leaf = self.hf_ds_config.find_config_node(key)
            if node is not None and node.get(leaf) == AUTO and value not in (None, AUTO, "none"):
                node[leaf] = value
        for name, key in _FIELD_KEYS.items():
            value = self.hf_ds_config.get_value(key)
            if value is not None and value != AUTO:
                setattr(self, name, value)
        if self.zero_stage is None:
            self.zero_stage = self.hf_ds_config.stage

    @classmethod
    def view(cls, config: DeepSpeedConfig | dict | str | os.PathLike) -> DeepSpeedPlugin:
        """The plugin accelerate would show for a config given as ``deepspeed_config=`` (a path, a dict or a loaded
        config, which is left as it is: accelerate's plugin defaults are not written into it)."""
        hf_config = config if isinstance(config, DeepSpeedConfig) else DeepSpeedConfig(config)
        plugin = cls.__new__(cls)
        for name, f in cls.__dataclass_fields__.items():
            setattr(plugin, name, f.default)
        plugin.hf_ds_config = hf_config
        for name, key in _FIELD_KEYS.items():
            setattr(plugin, name, hf_config.get_value(key))
        plugin.zero_stage = hf_config.stage
        plugin.zero3_init_flag = hf_config.is_zero3()
        return plugin

    @property
    def deepspeed_config(self) -> dict[str, Any]:
        return self.hf_ds_config.config

    def is_auto(self, ds_key_long: str) -> bool:
        return self.hf_ds_config.is_auto(ds_key_long)

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        return self.hf_ds_config.get_value(ds_key_long, default)


class DummyOptim(OptimizerPlaceholder):
    """Stands for the optimizer a DeepSpeed config's ``optimizer`` block makes: ``prepare`` returns that one.

    ``params`` (parameters or parameter groups) are what it optimizes; ``lr`` and ``weight_decay`` (and
    ``betas``/``eps`` among ``kwargs``) fill the block's ``"auto"`` values.
    """

    def __init__(self, params: Iterable[Any], lr: float = 0.001, weight_decay: float = 0, **kwargs: Any) -> None:
        self.params = params
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs

    def hyper_parameters(self) -> dict[str, Any]:
        """What fills the optimizer block's ``"auto"`` values, in the form a torch optimizer's ``defaults`` has."""
        return {**self.kwargs, "lr": self.lr, "weight_decay": self.weight_decay}


class DummyScheduler(SchedulerPlaceholder):
    """Stands for the scheduler a DeepSpeed config's ``scheduler`` block makes, or ``lr_scheduler_callable``'s.

    ``total_num_steps`` (counted over the unsharded loader, as accelerate's examples do: it is divided by the
    number of processes unless batches are split) and ``warmup_num_steps`` fill the block's ``"auto"`` values.
    DeepSpeed steps it at each optimizer step; the prepared scheduler's ``step()`` does nothing.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int | None = None,
        warmup_num_steps: int = 0,
        lr_scheduler_callable: Callable[[Any], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs


class SteppedByEngine:
    """A scheduler the backend (DeepSpeed's engine) steps at each optimizer step: ``step()`` does nothing."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)
