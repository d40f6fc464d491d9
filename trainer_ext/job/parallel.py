"""The parallel sizes of a job (``--dp_replicate_size``, ``--dp_shard_size``, ``--tp_size``, ``--cp_size`` with
``--cp_backend``, ``--pp_size`` with ``--pp_schedule`` and ``--pp_microbatches``) as a ``ParallelismConfig``, the mesh
they give on a number of processes, and the model-config checks tensor, context and pipeline parallelism need, shared
by ``train``, ``launch`` and ``estimate``. Imports neither torch nor transformers at module level.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainer_ext.distributed.mesh.config import CP_BACKENDS, PP_SCHEDULES, ParallelismConfig
from trainer_ext.distributed.mesh.device_mesh import fit_to_world
from trainer_ext.distributed.mesh.tensor_parallel import check_split_sizes
from trainer_ext.errors import ConfigError
from trainer_ext.job.fields import TASKS

TASKS_DEFAULT = TASKS[0]  # train's default task

# the sizes a train job takes as flags; the launcher takes sp_size too (accelerate's key), refused when > 1
TRAIN_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "pp_size")
LAUNCH_SIZES = (*TRAIN_SIZES, "sp_size")
# the options that go with a size: the context-parallel backend, the pipeline's schedule and microbatches
PIPELINE_OPTIONS = ("pp_schedule", "pp_microbatches")
DEFAULT_CP_BACKEND = CP_BACKENDS[0]  # auto: torch's ring attention on CUDA, our all-gather attention elsewhere
DEFAULT_PP_SCHEDULE = PP_SCHEDULES[0]  # 1f1b


def parallelism_from_sizes(
    sizes: Mapping[str, Any],
    cp_backend: str | None = None,
    pp_schedule: str | None = None,
    pp_microbatches: int | None = None,
) -> ParallelismConfig | None:
    """The ``ParallelismConfig`` of the sizes given (None = not given = 1), ``cp_backend`` (None: auto),
    ``pp_schedule`` (None: 1f1b) and ``pp_microbatches`` (None: the schedule's default); None when every size is 1
    or unset.

    Sizes not given are 1 here, the backend auto and the schedule 1f1b, never read from ``PARALLELISM_CONFIG_*``:
    flags say the whole configuration. A bad size, backend or schedule, or sp above 1, is the config's one-line
    ConfigError."""
    given = {name: value for name, value in sizes.items() if value is not None}
    if not given or all(value == 1 and not isinstance(value, bool) for value in given.values()):
        return None
    return ParallelismConfig(
        **{name: given.get(name, 1) for name in LAUNCH_SIZES},
        cp_backend=cp_backend or DEFAULT_CP_BACKEND,
        pp_schedule=pp_schedule or DEFAULT_PP_SCHEDULE,
        pp_microbatches=pp_microbatches,
    )


def fitted(config: ParallelismConfig | None, world_size: int) -> ParallelismConfig:
    """A copy of ``config`` (no config: all sizes 1) fitted to ``world_size`` by accelerate's rule (all sizes 1 on
    several processes is plain data parallelism over all of them; ours: ``pp_size`` alone on a multiple of it shards
    each stage over the rest); ConfigError when the sizes do not multiply to it."""
    copy = ParallelismConfig(
        **{name: getattr(config, name, 1) if config else 1 for name in LAUNCH_SIZES},
        cp_backend=getattr(config, "cp_backend", None) or DEFAULT_CP_BACKEND,
        pp_schedule=getattr(config, "pp_schedule", None) or DEFAULT_PP_SCHEDULE,
        pp_microbatches=getattr(config, "pp_microbatches", None),
    )
    fit_to_world(copy, world_size)
    return copy


def data_parallel_ranks(config: ParallelismConfig) -> int:
    """Ranks that see different batches: the world over the ranks that share one (tensor × context × sequence ×
    pipeline: ``non_data_parallel_size`` counts the pipeline's stages)."""
    return config.total_size // config.non_data_parallel_size


def pipeline_text(config: ParallelismConfig, ranges: list[tuple[int, int]] | None = None) -> str:
    """The pipeline in one phrase, e.g. ``2 stages (layers 0-3 | 4-7), 1f1b, 4 microbatches, bubble 20%`` (the
    layers when ``ranges`` are known; the microbatches the schedule's default when unset); empty without pp."""
    if config.pp_size <= 1:
        return ""
    from trainer_ext.distributed.pipeline.schedules import describe

    return describe(config.pp_size, config.pp_schedule or DEFAULT_PP_SCHEDULE, config.pp_microbatches, ranges)


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


def check_model_for_cp(config: Any, cp_size: int, source: str) -> None:
    """Refuse, before any process starts, a model context parallelism over ``cp_size`` ranks would train wrongly
    (sliding-window, chunked, bidirectional, encoder, soft-capped: the mesh module's rule, on the config alone)."""
    if cp_size <= 1:
        return
    from trainer_ext.distributed.mesh.cp_model import check_model

    try:
        check_model(config, cp_size)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None


def check_cp_job(values: Mapping[str, Any], cp_size: int) -> list[str]:
    """What context parallelism needs of a train job besides its model: a causal-lm task (the batch is split along
    the sequence and the labels shifted before the split). Notes a ``max_seq_length`` below ``cp_size``: every
    sequence is padded to a multiple of ``2 × cp_size`` chunks and trains exactly, but some ranks then hold padding
    only."""
    if cp_size <= 1:
        return []
    task = str(values.get("task") or TASKS_DEFAULT).strip().lower().replace("_", "-")
    if task != "causal-lm":
        raise ConfigError(
            f"cp_size {cp_size}: context parallelism splits causal language models' sequences, and the task is "
            f"{task}; use --task causal-lm, or set cp_size 1 (use dp_shard_size or tp_size)"
        )
    length = values.get("max_seq_length")
    if isinstance(length, int) and not isinstance(length, bool) and length < cp_size:
        return [
            f"max_seq_length {length} with cp_size {cp_size}: each sequence is padded to {2 * cp_size} positions "
            f"(2 chunks per rank), so {cp_size - length} of the {cp_size} context-parallel ranks hold only padding; "
            f"a smaller cp_size does the same work"
        ]
    return []


def pipeline_stages(config: Any) -> int:
    """How many stages (model chunks) ``config``'s pipeline has: ``pp_size`` × the schedule's stages per rank."""
    from trainer_ext.distributed.pipeline.schedules import stages_per_rank

    return config.pp_size * stages_per_rank(config.pp_schedule or DEFAULT_PP_SCHEDULE)


def meta_causal_lm(config: Any) -> Any:
    """The causal-LM model of a transformers config with its weights on the meta device (no memory, no values):
    what the pipeline's split reads; None when transformers has no causal LM for it."""
    import torch
    import transformers

    try:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError):
        return None


def pipeline_ranges(config: Any, stages: int) -> list[tuple[int, int]] | None:
    """Each stage's decoder layers ``[start, end)`` by the pipeline's balanced split of ``config``'s model (built on
    the meta device); None when the model cannot be split."""
    from trainer_ext.distributed.pipeline.split import layer_ranges, why_not

    model = meta_causal_lm(config)
    if model is None or why_not(model, stages) is not None:
        return None
    return layer_ranges(model, stages)


def check_model_for_pp(config: Any, stages: int, source: str) -> None:
    """Refuse, before any process starts, a model the pipeline cannot split into ``stages`` stages (the pipeline
    module's rule, :func:`~trainer_ext.distributed.pipeline.split.why_not`, on the model built on the meta
    device): not a llama/mistral/qwen2/qwen3 causal LM, tied embeddings, sliding windows, fewer layers than stages."""
    if stages <= 1:
        return
    from trainer_ext.distributed.pipeline.split import why_not

    model = meta_causal_lm(config)
    kind = getattr(config, "model_type", None) or type(config).__name__
    reason = why_not(model, stages) if model is not None else f"{kind} has no causal-LM model to split into stages"
    if reason is not None:
        raise ConfigError(
            f"{source}: pipeline of {stages} stages: {reason}; set pp_size 1 (use dp_shard_size), or train another model"
        )


def check_pp_job(values: Mapping[str, Any], pp_size: int) -> None:
    """What pipeline parallelism needs of a train job besides its model: a causal-lm task (the stages run a causal
    LM's decoder and the last one its loss)."""
    if pp_size <= 1:
        return
    task = str(values.get("task") or TASKS_DEFAULT).strip().lower().replace("_", "-")
    if task != "causal-lm":
        raise ConfigError(
            f"pp_size {pp_size}: pipeline parallelism splits causal language models into stages, and the task is "
            f"{task}; use --task causal-lm, or set pp_size 1 (use dp_shard_size)"
        )


def check_job_model(values: Mapping[str, Any], tp_size: int, cp_size: int = 1, pp_stages: int = 1) -> list[str]:
    """The train job's model from its flag values (a local pretrained model, a ``--model_config`` or the task's
    preset) checked against ``tp_size`` (:func:`check_model_for_tp`), ``cp_size`` (:func:`check_cp_job`,
    :func:`check_model_for_cp`) and the pipeline's ``pp_stages`` (:func:`check_pp_job`, :func:`check_model_for_pp`;
    :func:`pipeline_stages` of the config), before any process group; notes when its config cannot be read here (a
    hub id: checked when the model is built)."""
    import os

    from trainer_ext.job.fields import DEFAULT_PRESET, PRESETS
    from trainer_ext.job.model_limits import load_model_config

    notes = check_cp_job(values, cp_size)
    check_pp_job(values, pp_stages)
    if tp_size <= 1 and cp_size <= 1 and pp_stages <= 1:
        return notes
    name = values.get("model_name_or_path")
    if name:
        if not os.path.exists(os.path.expanduser(name)):
            named = (("tp_size", tp_size), ("cp_size", cp_size), ("pipeline stages", pp_stages))
            sizes = " and ".join(f"{n} {s}" for n, s in named if s > 1)
            return [*notes, f"{sizes}: {name!r} is checked when train loads its config"]
        config = load_model_config(name, "--model_name_or_path", bool(values.get("trust_remote_code")))
        source = f"--model_name_or_path {name}"
        check_model_for_tp(config, tp_size, source, vocab=True)  # train pads no vocabulary
        check_model_for_cp(config, cp_size, source)
        check_model_for_pp(config, pp_stages, source)
        return notes
    task = str(values.get("task") or TASKS_DEFAULT).strip().lower().replace("_", "-")
    preset = values.get("model_config") or DEFAULT_PRESET.get(task)
    if preset is None:
        return notes  # an unknown task: train names it
    if preset in PRESETS:
        import transformers

        config, source = transformers.AutoConfig.for_model(**PRESETS[preset]), f"the preset {preset}"
    else:
        config, source = load_model_config(preset), f"--model_config {preset}"
    check_model_for_tp(config, tp_size, source)
    check_model_for_cp(config, cp_size, source)
    check_model_for_pp(config, pp_stages, source)
    return notes


def auto_parallelism(args: Any) -> str | None:
    """What ``--parallelism auto`` was set to (the start-up block's text); None unless the job asks for it.
    ConfigError when it reaches the job unresolved: the trainer-ext CLI resolves it before any process starts."""
    import os

    from trainer_ext import env_vars

    if getattr(args, "parallelism", None) != "auto":
        return None
    text = os.environ.get(env_vars.PARALLELISM_AUTO)
    if not text:
        raise ConfigError(
            "--parallelism auto is resolved by the trainer-ext CLI before the processes start (trainer-ext train, or "
            "trainer-ext launch ... train); from Python, pass the layout flags `trainer-ext plan` prints for the job "
            "instead (or parallelism='manual')"
        )
    return text
