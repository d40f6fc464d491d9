"""Launch config files: where the file is, and what its keys mean, ours and those of accelerate's YAML.

A file written by ``trainer-ext config`` uses accelerate's key names, so a file written by
``accelerate config`` is read the same way. Every key is either mapped to a launch setting (the
source says which key it came from), named as ignored (accelerate keys that do nothing here), or a
problem (unknown keys and bad values, with the closest valid names). Nothing here raises: problems are
collected so ``trainer-ext config validate`` can list them all.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer_ext.config_files import load_mapping
from trainer_ext.distributed.mesh.config import CP_BACKENDS, PP_SCHEDULES
from trainer_ext.env_vars import CONFIG_FILE
from trainer_ext.errors import ConfigError, did_you_mean
from trainer_ext.values import MIXED_PRECISION, is_true, parse_bool

RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP")

# accelerate keys that have no effect here, with the reason `config validate` prints.
IGNORED_KEYS: dict[str, str] = {
    "same_network": "the rendezvous always uses main_process_ip:main_process_port",
    "main_training_function": "only for accelerate's notebook launcher",
    "enable_cpu_affinity": "not supported; bind processes with numactl/taskset if needed",
    "downcast_bf16": "TPU only",
    "tpu_name": "TPU only",
    "tpu_zone": "TPU only",
    "tpu_use_cluster": "TPU only",
    "tpu_use_sudo": "TPU only",
    "tpu_vm": "TPU only",
    "tpu_env": "TPU only",
    "command_file": "TPU only",
    "commands": "TPU only",
    "dynamo_config": "use the training flag --torch_compile instead",
    "dynamo_backend": "use the training flag --torch_compile instead",
    "fp8_config": "fp8 recipes are not read from the launch config",
    "megatron_lm_config": "Megatron-LM is not supported",
    "ipex_config": "IPEX is not supported",
    "mpirun_config": "start with mpirun yourself; trainer_ext reads OpenMPI's variables",
    "use_mps_device": "older accelerate key; one process uses an Apple GPU (MPS) by itself",
}
SHARDING = {
    "1": "full_shard",
    "FULL_SHARD": "full_shard",
    "2": "shard_grad_op",
    "SHARD_GRAD_OP": "shard_grad_op",
    "3": "no_shard",
    "NO_SHARD": "no_shard",
    "4": "hybrid_shard",
    "HYBRID_SHARD": "hybrid_shard",
    "5": "hybrid_shard_zero2",
    "HYBRID_SHARD_ZERO2": "hybrid_shard_zero2",
}


def default_config_path(environ: Mapping[str, str] | None = None) -> Path:
    """``$TRAINER_EXT_CONFIG_FILE``, else ``~/.cache/trainer_ext/default_config.yaml``."""
    env = os.environ if environ is None else environ
    if env.get(CONFIG_FILE):
        return Path(env[CONFIG_FILE]).expanduser()
    return Path("~/.cache/trainer_ext/default_config.yaml").expanduser()


def find_config_file(explicit: str | None, environ: Mapping[str, str] | None = None) -> tuple[Path | None, str]:
    """The config file to read and why: ``--config_file``, then the env variable, then the default if present."""
    env = os.environ if environ is None else environ
    if explicit:
        return Path(explicit).expanduser(), "--config_file"
    if env.get(CONFIG_FILE):
        return default_config_path(env), f"${CONFIG_FILE}"
    path = default_config_path(env)
    return (path, "default location") if path.is_file() else (None, f"none ({path} does not exist)")


@dataclass
class ConfigFile:
    """What one config file says: launch settings with their source, ignored keys, and problems."""

    path: Path
    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def set(self, name: str, value: Any, key: str | None = None) -> None:
        self.values[name] = value
        where = f"config file {self.path}"
        self.sources[name] = f"{where}, accelerate key {key}" if key else where

    def problem(self, text: str) -> None:
        self.problems.append(f"{self.path}: {text}")


def whole_number(minimum: int, maximum: int | None = None) -> Callable[[Any], int]:
    """A converter to an int in [minimum, maximum]; ValueError says what is wrong."""

    def check(value: Any) -> int:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, str))
            or not str(value).strip().lstrip("-").isdigit()
        ):
            raise ValueError(f"{value!r} is not a whole number")
        number = int(value)
        if number < minimum or (maximum is not None and number > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
            raise ValueError(f"{number} must be {bound}")
        return number

    return check


def one_of(choices: tuple[str, ...], upper: bool = False) -> Callable[[Any], str]:
    """A converter that accepts one of ``choices`` (case-insensitive) and names the closest otherwise."""

    def check(value: Any) -> str:
        if value is False and "no" in choices:  # YAML reads a bare `no` as false
            return "no"
        text = str(value).strip()
        text = text.upper() if upper else text.lower()
        if text not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}.{did_you_mean(text, choices)}")
        return text

    return check


def gpu_ids(value: Any) -> str:
    """``all`` or a comma-separated list of GPU indices (YAML may give one int)."""
    text = str(value).strip().replace(" ", "")
    if text.lower() == "all":
        return "all"
    parts = text.split(",")
    if not text or not all(p.isdigit() for p in parts):
        raise ValueError(f"{value!r} is not 'all' or a list of GPU indices like 0,1")
    if len(set(parts)) != len(parts):
        raise ValueError(f"{value!r} names a GPU twice")
    return ",".join(str(int(p)) for p in parts)


def host(value: Any) -> str:
    """A host name or IP address (no spaces)."""
    text = str(value).strip()
    if not text or " " in text:
        raise ValueError(f"{value!r} is not a host name or IP address")
    return text


# Upper bounds far beyond any real job, so that a typo or a crafted value (10**23 processes) is refused up front
# instead of reaching torchrun; each message states the valid range.
MAX_MACHINES = 1 << 16
MAX_PROCESSES_PER_MACHINE = 1 << 10
MAX_PROCESSES = MAX_MACHINES * 16
MAX_RESTARTS = 10_000
MAX_ACCUMULATION = 1 << 20

# the parallel sizes, the context-parallel backend and the pipeline's schedule and microbatches (pp: ours): top-level
# keys, or under parallelism_config as accelerate writes them (parallelism_config_tp_size, ...; the bare names too), or
# tp_config.tp_size (older accelerate)
PARALLEL_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size", "pp_size")
PARALLEL_KEYS = (*PARALLEL_SIZES, "cp_backend", "pp_schedule", "pp_microbatches")
PARALLEL_PREFIX = "parallelism_config_"
# accelerate's options for torch's ring attention and sequence parallelism: nothing to do here (sp_size stays 1)
PARALLEL_IGNORED = (
    "cp_comm_strategy",
    "sp_backend",
    "sp_seq_length",
    "sp_seq_length_is_variable",
    "sp_attn_implementation",
)

# Keys mapped one to one onto the launch setting of the same name: key -> converter.
PLAIN_KEYS: dict[str, Callable[[Any], Any]] = {
    "num_processes": whole_number(1, MAX_PROCESSES),
    "num_machines": whole_number(1, MAX_MACHINES),
    "machine_rank": whole_number(0, MAX_MACHINES - 1),
    "main_process_ip": host,
    "main_process_port": whole_number(1, 65535),
    "rdzv_backend": one_of(RDZV_BACKENDS),
    "max_restarts": whole_number(0, MAX_RESTARTS),
    "gpu_ids": gpu_ids,
    "mixed_precision": one_of(MIXED_PRECISION),
    "gradient_accumulation_steps": whole_number(1, MAX_ACCUMULATION),
    "debug": parse_bool,
    **dict.fromkeys(PARALLEL_SIZES, whole_number(1, MAX_PROCESSES)),
    "cp_backend": one_of(CP_BACKENDS),
    "pp_schedule": one_of(PP_SCHEDULES),
    "pp_microbatches": whole_number(1, MAX_ACCUMULATION),
}
SPECIAL_KEYS = ("compute_environment", "distributed_type", "use_cpu", "deepspeed_config", "fsdp_config", "fp16")
SPECIAL_KEYS += ("parallelism_config", "tp_config")
KNOWN_KEYS = (*PLAIN_KEYS, *SPECIAL_KEYS, *IGNORED_KEYS)


def read_config_file(path: Path | str) -> ConfigFile:
    """Read a YAML or JSON launch config; every problem is collected, nothing is raised."""
    config = ConfigFile(Path(path))
    try:
        data = load_mapping(config.path, "launch config")
    except ConfigError as error:
        config.problems.append(str(error))
        return config
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    for key, value in data.items():
        if key in PLAIN_KEYS:
            _plain(config, key, value)
        elif key in IGNORED_KEYS:
            config.ignored.append(key)
        elif key not in SPECIAL_KEYS:
            config.problem(f"unknown key {key!r}.{did_you_mean(key, KNOWN_KEYS)}")
    _compute_environment(config, data)
    _distributed_type(config, data)
    if "use_cpu" in data:
        _convert(config, "use_cpu", data["use_cpu"], parse_bool, lambda v: config.set("cpu", v, "use_cpu"))
    if data.get("fp16") and "mixed_precision" not in data:  # accelerate's older format
        config.set("mixed_precision", "fp16", "fp16")
    _deepspeed(config, data.get("deepspeed_config"))
    _fsdp(config, data.get("fsdp_config"))
    _parallelism(config, "parallelism_config", data.get("parallelism_config"))
    _parallelism(config, "tp_config", data.get("tp_config"))
    return config


def _parallelism(config: ConfigFile, key: str, section: Any) -> None:
    """The sizes under ``parallelism_config`` (accelerate's prefixed names or the bare ones) or ``tp_config``; a size
    given at the top level as well wins there."""
    if section is None or section == {}:
        return
    if not isinstance(section, Mapping):
        config.problem(f"{key} must be a mapping of sizes (e.g. {PARALLEL_PREFIX}tp_size: 2), not {section!r}")
        return
    valid = [*PARALLEL_KEYS, *PARALLEL_IGNORED] if key == "parallelism_config" else ["tp_size"]
    for name, value in section.items():
        bare = str(name).replace("-", "_").removeprefix(PARALLEL_PREFIX)
        where = f"{key}.{name}"
        if bare not in valid:
            config.problem(f"unknown key {where!r}.{did_you_mean(bare, valid)}")
        elif bare in PARALLEL_IGNORED:
            config.ignored.append(where)
        elif value is not None and bare not in config.values:
            _convert(
                config, where, value, PLAIN_KEYS[bare], lambda v, bare=bare, where=where: config.set(bare, v, where)
            )


def _convert(config: ConfigFile, key: str, value: Any, convert: Callable[[Any], Any], store: Callable) -> None:
    try:
        converted = convert(value)
    except ValueError as error:
        config.problem(f"{key}: {error}")
        return
    store(converted)


def _plain(config: ConfigFile, key: str, value: Any) -> None:
    if value is None:
        return
    if key == "num_processes" and value == -1:  # accelerate's "not set" placeholder
        return
    _convert(config, key, value, PLAIN_KEYS[key], lambda v: config.set(key, v))


def _compute_environment(config: ConfigFile, data: Mapping[str, Any]) -> None:
    value = str(data.get("compute_environment") or "LOCAL_MACHINE").upper()
    if value != "LOCAL_MACHINE":
        config.problem(
            f"compute_environment {value} is not supported; trainer_ext launches on machines you log into "
            "(LOCAL_MACHINE), including SLURM clusters (see scripts/slurm.sbatch)"
        )


def _distributed_type(config: ConfigFile, data: Mapping[str, Any]) -> None:
    """NO: one process unless said otherwise; MULTI_CPU: CPU processes; MULTI_GPU: one process per GPU."""
    if data.get("distributed_type") is None:
        return
    value = str(data["distributed_type"]).upper()
    if value not in DISTRIBUTED_TYPES:
        config.problem(
            f"distributed_type {value} is not supported; use one of {', '.join(DISTRIBUTED_TYPES)}."
            f"{did_you_mean(value, DISTRIBUTED_TYPES)}"
        )
        return
    config.set("distributed_type", value)
    key = f"distributed_type={value}"
    if value == "NO" and "num_processes" not in config.values:
        config.set("num_processes", 1, key)
    elif value == "MULTI_CPU" and "use_cpu" not in data:
        config.set("cpu", True, key)
    elif value == "MULTI_GPU":
        config.set("require_gpu", True, key)
    elif value == "DEEPSPEED" and not isinstance(data.get("deepspeed_config"), (Mapping, str)):
        config.problem("distributed_type DEEPSPEED needs deepspeed_config.deepspeed_config_file (a DeepSpeed JSON)")
    elif value == "FSDP" and not data.get("fsdp_config"):
        config.problem("distributed_type FSDP needs fsdp_config (a mapping, or the path of an FSDP config file)")


# accelerate's inline DeepSpeed keys (what `accelerate config` writes) → places in a DeepSpeed JSON config
DEEPSPEED_INLINE = {
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "gradient_clipping": "gradient_clipping",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}
# ignored: ZeRO-3 models are built partitioned by from_pretrained anyway; trainer-ext launch starts the
# processes (torchrun), not DeepSpeed's launcher; the top-level mixed_precision is the one used
DEEPSPEED_INLINE_IGNORED = (
    "zero3_init_flag",
    "deepspeed_multinode_launcher",
    "deepspeed_hostfile",
    "deepspeed_exclusion_filter",
    "deepspeed_inclusion_filter",
    "mixed_precision",
)


def _inline_section(config: ConfigFile, key: str, section: Any, setting: str) -> Mapping[str, Any] | None:
    """The inline mapping under ``key``; a path (our own shorthand) is stored as ``setting`` and gives None."""
    if not section:
        return None
    if isinstance(section, str):
        config.set(setting, section)
    elif not isinstance(section, Mapping):
        config.problem(f"{key} must be a mapping or a file path, not {type(section).__name__}")
    else:
        return section
    return None


def _deepspeed(config: ConfigFile, section: Any) -> None:
    """The DeepSpeed JSON path, or accelerate's inline ZeRO keys turned into a DeepSpeed config."""
    section = _inline_section(config, "deepspeed_config", section, "deepspeed")
    if section is None:
        return
    file = section.get("deepspeed_config_file")
    if "gradient_accumulation_steps" in section and "gradient_accumulation_steps" not in config.values:
        _convert(
            config,
            "deepspeed_config.gradient_accumulation_steps",
            section["gradient_accumulation_steps"],
            PLAIN_KEYS["gradient_accumulation_steps"],
            lambda v: config.set("gradient_accumulation_steps", v, "deepspeed_config.gradient_accumulation_steps"),
        )
    inline = {k: v for k, v in section.items() if k in DEEPSPEED_INLINE}
    for key in sorted(set(section) - set(DEEPSPEED_INLINE) - set(DEEPSPEED_INLINE_IGNORED)):
        if key not in ("deepspeed_config_file", "gradient_accumulation_steps"):
            config.problem(
                f"unknown key 'deepspeed_config.{key}'."
                + did_you_mean(key, [*DEEPSPEED_INLINE, *DEEPSPEED_INLINE_IGNORED, "deepspeed_config_file"])
            )
    config.ignored += [f"deepspeed_config.{k}" for k in section if k in DEEPSPEED_INLINE_IGNORED]
    if file:  # the JSON file is used as it is
        config.set("deepspeed", str(file), "deepspeed_config.deepspeed_config_file")
        config.ignored += [f"deepspeed_config.{k}" for k in inline]
    elif inline:
        built = _deepspeed_from_inline(config, inline)
        if built is not None:
            config.set("deepspeed", built, "deepspeed_config (accelerate's inline keys)")


def _deepspeed_from_inline(config: ConfigFile, inline: Mapping[str, Any]) -> dict | None:
    """A DeepSpeed config from accelerate's inline keys; the batch, accumulation and precision stay "auto"."""
    built: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2},
    }
    for key, value in inline.items():
        if key.endswith("_device") and str(value).lower() == "none":
            continue  # accelerate writes "none" for no offload
        if key == "zero_stage":
            try:
                value = int(value)
            except (TypeError, ValueError):
                config.problem(f"deepspeed_config.zero_stage {value!r} is not one of 0, 1, 2, 3")
                return None
        *parents, leaf = DEEPSPEED_INLINE[key].split(".")
        node = built
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return built


def _fsdp(config: ConfigFile, section: Any) -> None:
    """An FSDP config path, or accelerate's inline mapping passed on as JSON with the sharding it names."""
    section = _inline_section(config, "fsdp_config", section, "fsdp_config")
    if section is None:
        return
    strategy = section.get("fsdp_sharding_strategy")
    if strategy is None and "fsdp_reshard_after_forward" in section:  # accelerate's FSDP2 spelling
        strategy = "FULL_SHARD" if is_true(section["fsdp_reshard_after_forward"]) else "SHARD_GRAD_OP"
    sharding = SHARDING.get(str(strategy or "FULL_SHARD").upper())
    if sharding is None:
        config.problem(
            f"fsdp_config.fsdp_sharding_strategy {strategy!r} is not one of "
            f"{', '.join(k for k in SHARDING if not k.isdigit())}"
        )
        return
    if is_true(section.get("fsdp_offload_params")):
        sharding += " offload"
    config.set("fsdp", sharding, "fsdp_config.fsdp_sharding_strategy")
    config.set("fsdp_config", dict(section), "fsdp_config")
