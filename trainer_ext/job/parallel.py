"""The parallel sizes of a job (``--dp_replicate_size``, ``--dp_shard_size``, ``--tp_size``, ``--cp_size``) as a
``ParallelismConfig``, the mesh they give on a number of processes, and the model-config checks tensor parallelism
needs, shared by ``train``, ``launch`` and ``estimate``. Imports neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainer_ext.distributed.mesh.config import ParallelismConfig
from trainer_ext.distributed.mesh.device_mesh import fit_to_world
from trainer_ext.distributed.mesh.tensor_parallel import check_split_sizes
from trainer_ext.errors import ConfigError

# the sizes a train job takes as flags; the launcher takes sp_size too (accelerate's key), refused when > 1
TRAIN_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")
LAUNCH_SIZES = (*TRAIN_SIZES, "sp_size")


def parallelism_from_sizes(sizes: Mapping[str, Any]) -> ParallelismConfig | None:
    """The ``ParallelismConfig`` of the sizes given (None = not given = 1); None when every size is 1 or unset.

    Sizes not given are 1 here, never read from ``PARALLELISM_CONFIG_*``: flags say the whole configuration.
    A bad size, or cp/sp above 1, is the config's one-line ConfigError."""
    given = {name: value for name, value in sizes.items() if value is not None}
    if not given or all(value == 1 and not isinstance(value, bool) for value in given.values()):
        return None
    return ParallelismConfig(**{name: given.get(name, 1) for name in LAUNCH_SIZES})


def fitted(config: ParallelismConfig | None, world_size: int) -> ParallelismConfig:
    """A copy of ``config`` (no config: all sizes 1) fitted to ``world_size`` by accelerate's rule (all sizes 1 on
    several processes is plain data parallelism over all of them); ConfigError when the sizes do not multiply to it."""
    copy = ParallelismConfig(**{name: getattr(config, name, 1) if config else 1 for name in LAUNCH_SIZES})
    fit_to_world(copy, world_size)
    return copy


def data_parallel_ranks(config: ParallelismConfig) -> int:
    """Ranks that see different batches: the world over the ranks that share one (tensor × context × sequence)."""
    return config.total_size // config.non_data_parallel_size


def check_tp_config(
    values: Mapping[str, Any], tp_plan: Mapping[str, str] | None, tp_size: int, source: str, vocab: bool = False
) -> None:
    """Refuse a model that tensor parallelism over ``tp_size`` ranks cannot split, before any process starts: no
    plan (``base_model_tp_plan``), or a head count, key/value head count or intermediate size the plan splits that
    ``tp_size`` does not divide (the mesh module's rule, on the config alone); with ``vocab`` (a pretrained model: a
    vocabulary from scratch is padded) the ``vocab_size`` that the embedding's split by rows needs divisible.
    ``values``: the (text) config's fields."""
    if tp_size <= 1:
        return
    if not tp_plan:
        kind = values.get("model_type") or "this"
        raise ConfigError(
            f"tp_size {tp_size}: {source} is a {kind} model without a tensor-parallel plan "
            "(config.base_model_tp_plan is empty); set tp_size 1, or train a model that has one (llama, qwen2, "
            "mistral, ...)"
        )
    # transformers adds embed_tokens (split by vocabulary rows) to every plan of a model with input embeddings
    plan = {**tp_plan, "embed_tokens": "embedding_rowwise"}
    extra = (("vocab_size", ("embed_tokens",)),) if vocab else ()
    check_split_sizes(values, plan, tp_size, where=f" of {source}", extra=extra)


def check_model_for_tp(config: Any, tp_size: int, source: str, vocab: bool = False) -> None:
    """:func:`check_tp_config` on a transformers ``PretrainedConfig`` (its text config for a multimodal one)."""
    if tp_size <= 1:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    values = {**text.to_dict(), "model_type": getattr(config, "model_type", None)}
    check_tp_config(values, plan, tp_size, source, vocab)


def check_job_model(values: Mapping[str, Any], tp_size: int) -> list[str]:
    """:func:`check_model_for_tp` on a train job's model from its flag values (a local pretrained model, a
    ``--model_config`` or the task's preset), before any process group; notes when its config cannot be read here
    (a hub id: checked when the model is built)."""
    import os

    from trainer_ext.job.fields import DEFAULT_PRESET, PRESETS, TASKS
    from trainer_ext.job.model_limits import load_model_config

    if tp_size <= 1:
        return []
    name = values.get("model_name_or_path")
    if name:
        if not os.path.exists(os.path.expanduser(name)):
            return [f"tp_size {tp_size}: the heads of {name!r} are checked when train loads its config"]
        config = load_model_config(name, "--model_name_or_path", bool(values.get("trust_remote_code")))
        check_model_for_tp(config, tp_size, f"--model_name_or_path {name}", vocab=True)  # train pads no vocabulary
        return []
    task = str(values.get("task") or TASKS[0]).strip().lower().replace("_", "-")
    preset = values.get("model_config") or DEFAULT_PRESET.get(task)
    if preset is None:
        return []  # an unknown task: train names it
    if preset in PRESETS:
        import transformers

        check_model_for_tp(transformers.AutoConfig.for_model(**PRESETS[preset]), tp_size, f"the preset {preset}")
    else:
        check_model_for_tp(load_model_config(preset), tp_size, f"--model_config {preset}")
    return []
