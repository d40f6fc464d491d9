"""``trainer-ext config``: write a launch config by questions or defaults, or explain what is wrong with one.

    trainer-ext config [--config_file PATH]             questions on stdin; Enter takes the default
    trainer-ext config --default [--config_file PATH]   a file for this machine, no questions
    trainer-ext config validate FILE [--kind KIND]      the problems in FILE; exit code 2 if any

The file uses accelerate's key names (see :mod:`.launch.config_file`); it goes to ``--config_file``, else
``$TRAINER_EXT_CONFIG_FILE``, else ``~/.cache/trainer_ext/default_config.yaml``. ``validate`` also checks the
other kinds of config file (FSDP, DeepSpeed, train, model), each with the reader that will read it, the kind told by
the file's keys or ``--kind``.
"""

from __future__ import annotations

import argparse
import stat
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from trainer_ext.cli.launch import settings as launch_settings
from trainer_ext.cli.launch.config_file import (
    IGNORED_KEYS,
    KNOWN_KEYS,
    MIXED_PRECISION,
    default_config_path,
    gpu_ids,
    host,
    one_of,
    read_config_file,
    whole_number,
)
from trainer_ext.cli.launch.fsdp import fsdp_problems
from trainer_ext.config_files import JSON, file_format, load_mapping
from trainer_ext.errors import ConfigError, did_you_mean
from trainer_ext.values import parse_bool

HEADER = (
    "# Launch config for `trainer-ext launch` (written by `trainer-ext config`).\n"
    "# Keys follow accelerate's config format; check a file with `trainer-ext config validate FILE`.\n"
)
TRIES = 3


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise ConfigError(f"config: {message}")


def _optional_path(answer: str) -> str | None:
    return None if answer.strip().lower() in ("no", "none", "") else answer.strip()


class Questions:
    """Asks on stdout, reads answers from stdin (so tests can pipe them); Enter takes the default."""

    def __init__(self, read: Callable[[str], str] = input) -> None:
        self.read = read

    def ask(self, question: str, default: Any, convert: Callable[[str], Any]) -> Any:
        prompt = f"{question} [{default}]: " if default is not None else f"{question}: "
        for _ in range(TRIES):
            try:
                answer = self.read(prompt).strip()
            except EOFError:
                raise ConfigError(
                    f"no answer to {question!r} (input ended); answer every question, or run "
                    "`trainer-ext config --default`"
                ) from None
            if not answer and default is None:
                print("  an answer is needed")
                continue
            try:
                return convert(answer or str(default))
            except ValueError as error:
                print(f"  {error}; try again")
        raise ConfigError(f"no valid answer to {question!r} after {TRIES} tries")


def questionnaire(q: Questions, gpu_count: int) -> dict[str, Any]:
    """The config built from the answers, in accelerate's key names."""
    config: dict[str, Any] = {}
    config["compute_environment"] = q.ask(
        "Compute environment (LOCAL_MACHINE: this machine, or cluster machines you log into)",
        "LOCAL_MACHINE",
        one_of(("LOCAL_MACHINE",), upper=True),
    )
    kind = q.ask(
        "Machine type: NO (one process), MULTI_CPU (several CPU processes), MULTI_GPU (one process per GPU)",
        "MULTI_GPU" if gpu_count > 1 else "NO",
        one_of(("NO", "MULTI_CPU", "MULTI_GPU"), upper=True),
    )
    config["distributed_type"] = kind
    machines = 1 if kind == "NO" else q.ask("How many machines?", 1, whole_number(1))
    config["num_machines"], config["machine_rank"] = machines, 0
    if machines > 1:
        config["machine_rank"] = q.ask(f"Rank of this machine (0 to {machines - 1})", 0, whole_number(0, machines - 1))
        config["main_process_ip"] = q.ask("Address of machine 0, reachable from every machine", None, host)
        config["main_process_port"] = q.ask("Port on machine 0", 29500, whole_number(1, 65535))
        config["rdzv_backend"] = q.ask("Rendezvous backend (static, c10d)", "static", one_of(("static", "c10d")))
    per_machine = 2
    if kind == "MULTI_GPU":
        config["gpu_ids"] = q.ask("Which GPUs of each machine (all, or e.g. 0,1)", "all", gpu_ids)
        per_machine = max(1, gpu_count) if config["gpu_ids"] == "all" else len(config["gpu_ids"].split(","))
    config["num_processes"] = (
        1
        if kind == "NO"
        else q.ask("How many processes in total, over all machines?", per_machine * machines, whole_number(1))
    )
    if kind != "NO":
        deepspeed = q.ask("DeepSpeed: path of a DeepSpeed JSON config, or no", "no", _optional_path)
        if deepspeed:
            config["distributed_type"] = "DEEPSPEED"
            config["deepspeed_config"] = {"deepspeed_config_file": deepspeed}
        else:
            fsdp = q.ask("FSDP: path of an FSDP config file, or no", "no", _optional_path)
            if fsdp:
                config["distributed_type"] = "FSDP"
                config["fsdp_config"] = fsdp
    config["use_cpu"] = kind == "MULTI_CPU" or (
        kind == "NO"
        and gpu_count > 0
        and q.ask("Run on the CPU although GPUs are present? (yes/no)", "no", parse_bool)
    )
    config["mixed_precision"] = q.ask(f"Mixed precision ({', '.join(MIXED_PRECISION)})", "no", one_of(MIXED_PRECISION))
    return config


def default_config(gpu_count: int) -> dict[str, Any]:
    """One process per GPU on a machine with several GPUs; otherwise one process."""
    config: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE"}
    if gpu_count > 1:
        config.update(distributed_type="MULTI_GPU", num_processes=gpu_count, gpu_ids="all")
    else:
        config.update(distributed_type="NO", num_processes=1)
    config.update(num_machines=1, machine_rank=0, use_cpu=False, mixed_precision="no")
    return config


def write_config(path: Path, config: dict[str, Any]) -> None:
    """Write ``config`` as YAML with a header saying what it is; ConfigError when the file cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(HEADER + yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    except OSError as error:
        why = error.strerror or str(error)
        where = f" ({error.filename})" if error.filename and str(error.filename) != str(path) else ""
        raise ConfigError(f"cannot write {path}: {why}{where}; choose another --config_file") from None


def _check_target(path: Path, overwrite: bool) -> None:
    """Refuse, before any question, a path that is a folder, a FIFO or device (writing would block or go nowhere),
    one the file system refuses (too long), or an existing file not to be replaced."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return  # a new file; a folder that cannot be made is said by write_config
    except OSError as error:
        raise ConfigError(f"cannot write {path}: {error.strerror or error}; choose another --config_file") from None
    if stat.S_ISDIR(mode):
        raise ConfigError(
            f"{path} is a directory; --config_file takes the path of a file, e.g. {path / 'default_config.yaml'}"
        )
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{path} is not a regular file (a FIFO or a device); --config_file takes the path of a file")
    if not overwrite:
        raise ConfigError(f"{path} already exists; pass --overwrite to replace it, or --config_file elsewhere")


def explain(path: Path, how: str = "") -> tuple[list[str], str]:
    """Every problem with the launch config file at ``path``, and a report of what it resolves to."""
    config = read_config_file(path)
    settings = launch_settings.resolve({}, config)
    problems = config.problems + settings.problems + fsdp_problems(settings)
    lines = [_status_line(path, problems, "launch", how)]
    lines += [_item(p.removeprefix(f"{path}: ")) for p in problems]
    if config.ignored:
        lines.append("ignored accelerate keys (no effect in trainer_ext):")
        lines += [f"  - {k}: {IGNORED_KEYS.get(k, 'set by the DeepSpeed JSON file instead')}" for k in config.ignored]
    if settings.notes:
        lines += ["notes:"] + [f"  - {n}" for n in settings.notes]
    if not config.problems:
        lines += ["as launched on this machine:", settings.table()]
    return problems, "\n".join(lines)


# The kinds of config file trainer_ext reads, with the option that takes each.
KINDS = {
    "launch": "a launch config (trainer-ext launch --config_file)",
    "fsdp": "an FSDP config (--fsdp_config of launch or train)",
    "deepspeed": "a DeepSpeed config (--deepspeed of launch or train)",
    "train": "a train config (trainer-ext train --config)",
    "model": "a model config (--model_config of train or estimate)",
}
# The keys that tell each kind apart (a key may belong to several; the kind with most of the file's keys wins).
FSDP_KEYS = (
    "version",
    "sharding_strategy",
    "auto_wrap_policy",
    "transformer_layer_cls_to_wrap",
    "min_num_params",
    "reshard_after_forward",
    "cpu_offload",
    "offload_params",
    "activation_checkpointing",
    "hybrid_shard",
    "replicate_size",
    "param_dtype",
    "reduce_dtype",
    "state_dict_type",
)
DEEPSPEED_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero_optimization",
    "fp16",
    "bf16",
    "bfloat16",
    "optimizer",
    "scheduler",
    "steps_per_print",
    "wall_clock_breakdown",
    "zero_allow_untested_optimizer",
    "communication_data_type",
    "prescale_gradients",
    "gradient_predivide_factor",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "checkpoint",
    "data_types",
    "torch_autocast",
)

MODEL_KEYS = (
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
)


def _key_sets() -> dict[str, set[str]]:
    from trainer_ext.job.arguments import field_names

    return {
        "launch": set(KNOWN_KEYS),
        "fsdp": set(FSDP_KEYS),
        "deepspeed": set(DEEPSPEED_KEYS),
        "train": set(field_names()),
        "model": set(MODEL_KEYS),
    }


def detect_kind(path: Path) -> str:
    """The kind of config ``path`` holds, told by its keys; ConfigError naming the kinds when none fits."""
    data = load_mapping(path, "config file")
    names = [str(k).replace("-", "_") for k in data]
    scores = {kind: sum(_belongs(name, kind, keys) for name in names) for kind, keys in _key_sets().items()}
    # on a tie, what a file of that format usually is; DeepSpeed reads JSON only, so a YAML file is never one
    order = (
        ("deepspeed", "model", "train", "fsdp", "launch")
        if file_format(path) == JSON
        else ("launch", "train", "fsdp", "model")
    )
    best = max(order, key=lambda kind: scores[kind])
    if not scores[best]:
        what = (
            f"none of its keys ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})" if names else "it is empty"
        )
        raise ConfigError(
            f"cannot tell which kind of config {path} is: {what}; the kinds are {', '.join(KINDS)} (pass --kind KIND)"
        )
    return best


def _belongs(name: str, kind: str, keys: set[str]) -> bool:
    if kind == "fsdp":  # accelerate's spelling prefixes every FSDP key
        return name != "fsdp_config" and (name.startswith("fsdp_") or name in keys)
    return name in keys


def _status_line(path: Path, problems: Sequence[str], kind: str, how: str) -> str:
    status = "OK" if not problems else f"{len(problems)} problem(s)"
    return f"{path}: {status} as {KINDS[kind]}{how}"


def _item(problem: str) -> str:
    """A problem as a list item; lines under it (a YAML error's caret context) stay under it."""
    return "  - " + problem.replace("\n", "\n    ")


def _refused(path: Path, kind: str, how: str, problem: str) -> tuple[list[str], str]:
    """The report of a file its reader refused: the one problem the reader raises."""
    return [problem], "\n".join([_status_line(path, [problem], kind, how), _item(problem)])


def _explain_fsdp(path: Path, how: str) -> tuple[list[str], str]:
    from trainer_ext.distributed.strategies.fsdp.config import read_fsdp_settings

    try:
        settings, warnings = read_fsdp_settings(True, str(path))
    except ConfigError as error:
        return _refused(path, "fsdp", how, str(error))
    lines = [_status_line(path, [], "fsdp", how)]
    lines += ["notes:"] + [f"  - {w}" for w in warnings] if warnings else []
    lines.append("FSDP2 settings as train applies them (fully_shard):")
    lines += [f"  {k:<30} {v}" for k, v in settings.to_dict().items()]
    return [], "\n".join(lines)


def _explain_deepspeed(path: Path, how: str) -> tuple[list[str], str]:
    from trainer_ext.distributed.strategies.deepspeed.config import auto_keys, load_deepspeed_config, zero_stage

    try:
        config = load_deepspeed_config(str(path))
    except ConfigError as error:
        return _refused(path, "deepspeed", how, str(error))
    lines = [_status_line(path, [], "deepspeed", how), f"ZeRO stage {zero_stage(config)}"]
    autos = list(auto_keys(config))
    if autos:
        lines.append(f'"auto", filled from the train flags when the job starts: {", ".join(autos)}')
    return [], "\n".join(lines)


def _explain_train(path: Path, how: str) -> tuple[list[str], str]:
    from trainer_ext.estimate.job import parse_job_flags
    from trainer_ext.job.flags import load_config_file

    try:
        keys = load_config_file(str(path))
        values, _ = parse_job_flags(["--config", str(path)], 1)
    except ConfigError as error:
        return _refused(path, "train", how, str(error))
    lines = [_status_line(path, [], "train", how), "values as train reads them (flags on the command line win):"]
    lines += [f"  {k:<30} {values.get(k, v)!r}" for k, v in keys.items()]
    return [], "\n".join(lines)


def _explain_model(path: Path, how: str) -> tuple[list[str], str]:
    import transformers

    try:
        model_type = load_mapping(path, "model config").get("model_type")
        known = transformers.CONFIG_MAPPING.keys()
        if model_type not in known:
            raise ConfigError(
                f"model config {path}: model_type {model_type!r} is not one transformers knows (e.g. llama, gpt2, "
                f"bert).{did_you_mean(str(model_type), known)}"
            )
        config = transformers.AutoConfig.from_pretrained(str(path))
    except Exception as error:  # transformers' config classes raise their own validation errors, not ValueError
        problem = (
            str(error) if isinstance(error, ConfigError) else f"model config {path}: {' '.join(str(error).split())}"
        )
        return _refused(path, "model", how, problem)
    shape = {k: getattr(config, k, None) for k in ("num_hidden_layers", "hidden_size", "vocab_size")}
    lines = [
        _status_line(path, [], "model", how),
        f"{config.model_type}: " + ", ".join(f"{k} {v}" for k, v in shape.items()),
    ]
    lines.append("train sizes a model built from it to the tokenizer's vocabulary (estimate says when that differs)")
    return [], "\n".join(lines)


EXPLAINERS = {
    "launch": explain,
    "fsdp": _explain_fsdp,
    "deepspeed": _explain_deepspeed,
    "train": _explain_train,
    "model": _explain_model,
}


def _kind(text: str) -> str:
    if text not in KINDS:
        raise argparse.ArgumentTypeError(
            f"unknown kind {text!r}; the kinds are {', '.join(KINDS)}.{did_you_mean(text, KINDS)}"
        )
    return text


def run_validate(argv: Sequence[str]) -> int:
    """``trainer-ext config validate FILE``: print the report; exit code 2 when there is any problem."""
    parser = _Parser(
        prog="trainer-ext config validate",
        description="Check a config file: a launch config, an FSDP or DeepSpeed config, or a train config.",
    )
    parser.add_argument("file", metavar="FILE")
    parser.add_argument(
        "--kind", type=_kind, help=f"which kind FILE is ({', '.join(KINDS)}); default: told by its keys"
    )
    args = parser.parse_args(argv)
    path = Path(args.file)
    kind, how = (args.kind, "") if args.kind else (detect_kind(path), ", told by its keys (--kind to choose)")
    problems, report = EXPLAINERS[kind](path, how)
    print(report)
    return 2 if problems else 0


def run_config(argv: Sequence[str]) -> int:
    """``trainer-ext config``: the questionnaire, ``--default``, or ``validate FILE``."""
    if argv and argv[0] == "validate":
        return run_validate(argv[1:])
    parser = _Parser(prog="trainer-ext config", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--config_file", "--config-file", metavar="PATH", help="where to write the file")
    parser.add_argument("--default", action="store_true", help="write a config for this machine without questions")
    parser.add_argument("--overwrite", action="store_true", help="with --default: replace an existing file")
    args = parser.parse_args(argv)
    path = Path(args.config_file).expanduser() if args.config_file else default_config_path()
    gpu_count = launch_settings.visible_gpus()
    if args.default:
        _check_target(path, args.overwrite)
        config = default_config(gpu_count)
    else:
        _check_target(path, overwrite=True)  # a folder is refused before the questions; a file is replaced
        config = questionnaire(Questions(), gpu_count)
    existed = path.exists()
    write_config(path, config)
    print(f"{'replaced' if existed else 'wrote'} {path}")
    problems, report = explain(path)
    if problems:
        print("note: the file is written, but launching it on this machine would fail:", file=sys.stderr)
        print(report, file=sys.stderr)
    print(f"try it: trainer-ext launch --config_file {path} --dry_run train")
    return 0
