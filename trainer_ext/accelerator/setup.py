"""How ``Accelerator(...)``'s arguments become engine settings: accelerate's rules for accumulation, dataloader
configuration, RNG synchronisation and plugins, checked before anything starts."""

from __future__ import annotations

import os
import warnings
from typing import Any

from trainer_ext.accelerator.options import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    split_handlers,
)
from trainer_ext.distributed.data.shuffle import RNG_TYPES
from trainer_ext.distributed.engine import Engine
from trainer_ext.distributed.mesh import setup as mesh_setup
from trainer_ext.distributed.rules import check_precision
from trainer_ext.distributed.state import DistState, detect_topology
from trainer_ext.distributed.strategies import strategy_for
from trainer_ext.distributed.strategies.deepspeed.plugin import DeepSpeedPlugin
from trainer_ext.distributed.strategies.fsdp.config import FSDPSettings, parse_fsdp
from trainer_ext.distributed.strategies.fsdp.plugin import FullyShardedDataParallelPlugin
from trainer_ext.env_vars import DEEPSPEED_CONFIG as _ENV_DEEPSPEED  # what `trainer-ext launch --deepspeed` exports
from trainer_ext.env_vars import FSDP_CONFIG as _ENV_FSDP  # what `trainer-ext launch --fsdp_config` exports
from trainer_ext.env_vars import GRADIENT_ACCUMULATION_STEPS as _ENV_ACCUMULATION  # what `trainer-ext launch` exports
from trainer_ext.env_vars import MIXED_PRECISION as _ENV_PRECISION
from trainer_ext.errors import ConfigError

# accelerate arguments that configure its own plugins; ours take plain settings instead
_PLUGINS = {
    "torch_tp_plugin": "parallelism_config=ParallelismConfig(tp_size=...)",
    "megatron_lm_plugin": None,
    "dynamo_plugin": "dynamo_backend=<backend name>",
}


def accumulation_settings(steps: int, plugin: GradientAccumulationPlugin | None) -> dict[str, Any]:
    """The gradient state's settings as accelerate keeps them: the plugin's non-default values only (so
    ``adjust_scheduler``, default True, reads as False, as in accelerate 1.15). ``gradient_accumulation_steps`` or a
    plugin, not both; without either, the launcher's value."""
    if plugin is not None:
        if steps != 1:
            raise ConfigError(
                "You can only pass one of `gradient_accumulation_steps` and `gradient_accumulation_plugin`. Please "
                "only pass in the created `GradientAccumulationPlugin` object."
            )
    else:
        plugin = GradientAccumulationPlugin(
            num_steps=steps if steps != 1 else int(os.environ.get(_ENV_ACCUMULATION) or 1)
        )
    kwargs = plugin.to_kwargs()
    if int(kwargs.get("num_steps") or 1) < 1:
        raise ConfigError(f"gradient_accumulation_steps must be at least 1, got {kwargs['num_steps']}")
    return kwargs


def known_handlers(kwargs_handlers: list[Any] | None) -> dict[type, Any]:
    """``kwargs_handlers`` by class, refusing the classes the Accelerator does not take (and saying that
    ``InitProcessGroupKwargs(init_method=...)`` is not used: the launcher's environment starts the group)."""
    handlers = split_handlers(kwargs_handlers)
    known = (DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs, AutocastKwargs, ProfileKwargs)
    for cls in handlers:
        if cls not in known:
            raise ConfigError(
                f"Unsupported kwargs handler passed: {cls.__name__}; kwargs_handlers takes "
                f"{', '.join(k.__name__ for k in known)}"
            )
    init = handlers.get(InitProcessGroupKwargs)
    if init is not None and init.to_kwargs().get("init_method") is not None:
        warnings.warn(
            "InitProcessGroupKwargs(init_method=...) is not used: the process group starts from the launcher's "
            "environment (MASTER_ADDR/MASTER_PORT)",
            stacklevel=3,
        )
    return handlers


def refuse_plugins(arguments: dict[str, Any]) -> None:
    """accelerate's plugin objects configure accelerate; say which setting of ours does the same."""
    for name, instead in _PLUGINS.items():
        if arguments.get(name) is not None:
            fix = f"pass {instead}" if instead else "it has no counterpart in trainer_ext (see docs/accelerator.md)"
            raise ConfigError(f"Accelerator({name}=...) configures accelerate's own engine; {fix}")


def launched_deepspeed_config(fsdp_named: bool) -> str | None:
    """The DeepSpeed config ``trainer-ext launch --deepspeed`` gave a script (accelerate's ``launch --use_deepspeed``),
    for an Accelerator that names no DeepSpeed settings of its own; None without one."""
    launched = os.environ.get(_ENV_DEEPSPEED)
    if launched and fsdp_named:
        raise ConfigError(
            f"trainer-ext launch was given a DeepSpeed config ({_ENV_DEEPSPEED}={launched}) and this Accelerator FSDP "
            "settings (fsdp_config or fsdp_plugin); launch without --deepspeed, or drop the FSDP settings"
        )
    return launched or None


def fsdp_settings(
    plugin: Any, config: Any, deepspeed_named: bool
) -> tuple[FSDPSettings | None, FullyShardedDataParallelPlugin | None]:
    """``fsdp_plugin=`` or our ``fsdp_config=`` (else the FSDP settings ``trainer-ext launch --fsdp_config`` gave the
    script, as accelerate's ``launch --use_fsdp`` does): what FSDP2 applies, and the plugin ``state.fsdp_plugin``
    shows."""
    if plugin is not None and config is not None:
        raise ConfigError("fsdp_plugin and fsdp_config both configure FSDP; give one")
    if plugin is None and config is None:
        if not os.environ.get(_ENV_FSDP):
            return None, None
        if deepspeed_named:
            raise ConfigError(
                f"trainer-ext launch was given FSDP settings ({_ENV_FSDP}) and this Accelerator DeepSpeed settings; "
                "launch without --fsdp_config, or drop the DeepSpeed settings"
            )
        plugin = FullyShardedDataParallelPlugin()  # its fields take the launch's settings
    if plugin is not None:
        if not isinstance(plugin, FullyShardedDataParallelPlugin):  # a TypeError, as accelerate raises
            raise TypeError(
                f"`fsdp_plugin` must be a FullyShardedDataParallelPlugin object: got {type(plugin).__module__}."
                f"{type(plugin).__qualname__}; build it with `from trainer_ext import FullyShardedDataParallelPlugin`"
            )
        return plugin.settings, plugin
    settings = config if isinstance(config, FSDPSettings) else parse_fsdp(True, config)
    return settings, FullyShardedDataParallelPlugin.view(settings)


def deepspeed_settings(plugin: Any, plugins: Any, config: Any) -> tuple[Any, DeepSpeedPlugin | None]:
    """``deepspeed_plugin=`` (or its alias ``deepspeed_plugins=``) or our ``deepspeed_config=``: the config the
    strategy trains with, and the plugin ``accelerator.state.deepspeed_plugin`` shows (it reads the same config)."""
    if plugin is not None and plugins is not None:
        raise ConfigError("You cannot pass in both `deepspeed_plugins` and `deepspeed_plugin`.")
    plugin = plugin if plugin is not None else plugins
    if plugin is None:
        if config is None:
            return None, None
        plugin = DeepSpeedPlugin.view(config)
        return plugin.hf_ds_config, plugin
    if isinstance(plugin, dict):
        raise ConfigError(
            "several DeepSpeed plugins (a dict, one per model) are not supported by trainer_ext; pass one "
            "DeepSpeedPlugin"
        )
    if not isinstance(plugin, DeepSpeedPlugin):
        raise ConfigError(
            f"deepspeed_plugin must be a trainer_ext.DeepSpeedPlugin, got {type(plugin).__module__}."
            f"{type(plugin).__qualname__}; build it with `from trainer_ext import DeepSpeedPlugin`, or pass "
            "deepspeed_config=<a DeepSpeed JSON path or dict>"
        )
    if config is not None:
        raise ConfigError("deepspeed_plugin and deepspeed_config both configure DeepSpeed; give one")
    return plugin.hf_ds_config, plugin


def dataloader_configuration(
    config: DataLoaderConfiguration | None, split_batches: bool | None, even_batches: bool | None
) -> DataLoaderConfiguration:
    """The dataloader settings; the old ``split_batches=`` argument still works, as in accelerate (with its warning)."""
    if config is not None and split_batches is not None:
        raise ConfigError(
            "Passing `split_batches` to both the Accelerator and the DataLoaderConfiguration is not allowed; keep "
            "DataLoaderConfiguration(split_batches=...)"
        )
    config = config if config is not None else DataLoaderConfiguration()
    if split_batches is not None:
        warnings.warn(
            "Passing split_batches to the Accelerator is deprecated: pass "
            "dataloader_config=DataLoaderConfiguration(split_batches=...) instead",
            FutureWarning,
            stacklevel=3,
        )
        config.split_batches = bool(split_batches)
    if even_batches is not None:
        config.even_batches = bool(even_batches)
    return config


def rng_types_for(rng_types: list[str] | None) -> list[str]:
    names = ["generator"] if rng_types is None else [str(getattr(kind, "value", kind)) for kind in rng_types]
    unknown = [name for name in names if name not in RNG_TYPES]
    if unknown:
        raise ConfigError(f"rng_types {unknown} are not known; choose from {list(RNG_TYPES)}")
    return names


def strategy_settings(
    fsdp_config: Any, deepspeed_config: Any, ddp_handler: DistributedDataParallelKwargs | None
) -> tuple[str | None, dict[str, Any] | None]:
    if fsdp_config is not None and deepspeed_config is not None:
        raise ConfigError("fsdp_config and deepspeed_config both shard the model; give one")
    if deepspeed_config is not None:  # resolved at prepare(), when the batch size and optimizer are known
        return "deepspeed", {"config": deepspeed_config}
    if fsdp_config is not None:  # FSDP2 settings, read by fsdp_settings
        return "fsdp", {"settings": fsdp_config}
    if ddp_handler is not None:
        return None, ddp_handler.to_kwargs()
    return None, None


def build_engine(
    arguments: dict[str, Any], handlers: dict[type, Any], config: DataLoaderConfiguration, rng_types: list[str]
) -> Engine:
    """The engine an ``Accelerator`` runs on, from its ``__init__`` arguments (by name) and kwargs handlers; its
    state shows the DeepSpeed/FSDP plugins and the precision, as ``print(accelerator.state)`` does in accelerate."""
    a = arguments
    init_handler = handlers.get(InitProcessGroupKwargs)
    init = init_handler.to_kwargs() if init_handler is not None else {}
    parallelism = mesh_setup.as_parallelism_config(a["parallelism_config"])
    world_size = detect_topology().world_size
    mesh_setup.check_parallelism(parallelism, world_size, cpu=bool(a["cpu"]))
    deepspeed_config = a["deepspeed_config"]
    if a["deepspeed_plugin"] is None and a["deepspeed_plugins"] is None and deepspeed_config is None:
        deepspeed_config = launched_deepspeed_config(a["fsdp_config"] is not None or a["fsdp_plugin"] is not None)
    ds_config, ds_plugin = deepspeed_settings(a["deepspeed_plugin"], a["deepspeed_plugins"], deepspeed_config)
    fsdp, fsdp_view = fsdp_settings(a["fsdp_plugin"], a["fsdp_config"], ds_config is not None)
    strategy, options = strategy_settings(fsdp, ds_config, handlers.get(DistributedDataParallelKwargs))
    strategy_for(strategy, parallelism, world_size)  # a layout the backend cannot run: refused before the group
    state = DistState(cpu=a["cpu"], timeout=init.get("timeout", a["timeout"]), backend=init.get("backend"))
    mode = str(a["mixed_precision"] or os.environ.get(_ENV_PRECISION) or "no")
    check_precision(mode, state.device)
    scaler, autocast = handlers.get(GradScalerKwargs), handlers.get(AutocastKwargs)
    dynamo = a["dynamo_backend"]
    engine = Engine(
        state,
        mixed_precision=mode,
        seed=config.data_seed if config.data_seed is not None else a["seed"],
        split_batches=config.split_batches,
        dispatch_batches=config.dispatch_batches,
        even_batches=config.even_batches,
        use_seedable_sampler=config.use_seedable_sampler,
        rng_types=rng_types,
        strategy=strategy,
        strategy_options=options,
        device_placement=a["device_placement"],
        torch_compile={"backend": str(dynamo).lower()} if dynamo not in (None, "no", "NO") else None,
        gradient_accumulation_plugin_kwargs=accumulation_settings(
            a["gradient_accumulation_steps"], a["gradient_accumulation_plugin"]
        ),
        scaler_kwargs=scaler.to_kwargs() if scaler is not None else None,
        autocast_kwargs=autocast.to_kwargs() if autocast is not None else None,
        parallelism_config=parallelism,
    )
    state.deepspeed_plugin = ds_plugin
    state.fsdp_plugin = fsdp_view
    state.mixed_precision, state.strategy_type = mode, engine.distributed_type  # for print(state)
    return engine
