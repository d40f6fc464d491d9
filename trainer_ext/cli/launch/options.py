"""The launcher's command line: its own options, then the target (``SCRIPT.py``, ``-m MODULE`` or ``train``).

Options are spelled with underscores or dashes; every one defaults to None, so "not given" is told apart from
a value and the config file can fill it in (see :mod:`.settings`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from trainer_ext.cli.launch.config_file import CP_BACKENDS, MIXED_PRECISION, PP_SCHEDULES, RDZV_BACKENDS, one_of
from trainer_ext.cli.launch.target import USAGE, Target
from trainer_ext.errors import ConfigError, did_you_mean

PARALLEL_HELP = {
    "dp_replicate_size": "model replicas (data parallel; with --dp_shard_size: HSDP)",
    "dp_shard_size": "processes FSDP2 shards each replica over",
    "tp_size": "processes each layer is split over (tensor parallel, the model's own plan)",
    "cp_size": "processes each sequence is split over (context parallel; causal LMs with full attention)",
    "sp_size": "sequence parallel processes (not supported yet: 1)",
    "pp_size": "pipeline stages' processes (pipeline parallel; llama/mistral/qwen2/qwen3 causal LMs, untied)",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise ConfigError(f"launch: {message.removeprefix('argument ')}")


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    """An argparse type: one of ``choices``, else a one-line error naming them and the closest."""
    convert = one_of(choices)

    def check(text: str) -> str:
        try:
            return convert(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return check


def build_parser() -> argparse.ArgumentParser:
    """The launcher's own options (each also spelled with dashes); all default to None = not given."""
    p = _Parser(prog="trainer-ext launch", usage=USAGE, allow_abbrev=False, argument_default=None)
    add = p.add_argument
    add("--num_processes", type=int, metavar="N", help="processes in total, over all machines")
    add("--nproc_per_node", type=int, metavar="N", help="processes on each machine (torchrun's name)")
    add("--num_machines", "--nnodes", dest="num_machines", type=int, metavar="M", help="number of machines")
    add("--machine_rank", "--node_rank", dest="machine_rank", type=int, metavar="R", help="this machine: 0..M-1")
    add("--main_process_ip", metavar="HOST", help="address of machine 0 (needed with several machines)")
    add("--main_process_port", type=int, metavar="PORT", help="rendezvous port (default: free port / 29500)")
    add("--rdzv_backend", type=_one_of(RDZV_BACKENDS), help="several machines: static (default) or c10d")
    add("--rdzv_timeout", type=int, metavar="SECONDS", help="how long machines wait for each other")
    add("--max_restarts", type=int, metavar="N", help="restart the processes up to N times after a failure")
    add("--cpu", action="store_const", const=True, help="run on the CPU even if GPUs are present")
    add("--no_cpu", dest="cpu", action="store_const", const=False, help="undo use_cpu from a config file")
    add("--gpu_ids", metavar="IDS", help="GPUs to use on this machine: all, or e.g. 0,1")
    add("--mixed_precision", type=_one_of(MIXED_PRECISION), help="no, bf16, fp16 or fp8")
    add("--gradient_accumulation_steps", type=int, metavar="N", help="micro-batches per optimizer step")
    add(
        "--deepspeed",
        metavar="CONFIG",
        help="DeepSpeed JSON, passed to train as --deepspeed, to a script as TRAINER_EXT_DEEPSPEED_CONFIG",
    )
    add(
        "--fsdp_config",
        metavar="CONFIG",
        help="FSDP config, passed to train as --fsdp full_shard --fsdp_config, to a script as TRAINER_EXT_FSDP_CONFIG",
    )
    for name, text in PARALLEL_HELP.items():  # accelerate's --parallelism_config_<size> spelling too
        add(f"--{name}", f"--parallelism_config_{name}", dest=name, type=int, metavar="N", help=text)
    add(
        "--cp_backend",
        "--parallelism_config_cp_backend",
        dest="cp_backend",
        type=_one_of(CP_BACKENDS),
        help="context-parallel attention: auto (torch on CUDA, all_gather elsewhere), torch (CUDA) or all_gather",
    )
    add(
        "--pp_schedule",
        "--parallelism_config_pp_schedule",
        dest="pp_schedule",
        type=_one_of(PP_SCHEDULES),
        help=f"pipeline schedule: {', '.join(PP_SCHEDULES)} (default 1f1b)",
    )
    add(
        "--pp_microbatches",
        "--parallelism_config_pp_microbatches",
        dest="pp_microbatches",
        type=int,
        metavar="N",
        help="microbatches each batch is split into for the pipeline (default: one per stage)",
    )
    add(
        "--num_cpu_threads_per_process",
        type=int,
        metavar="N",
        help="CPU threads of each process (OMP_NUM_THREADS; default: the usable cores / processes per machine)",
    )
    add("--debug", action="store_const", const=True, help="TORCH_DISTRIBUTED_DEBUG=DETAIL in every process")
    add("--config_file", metavar="FILE", help="launch config (default: $TRAINER_EXT_CONFIG_FILE or ~/.cache/...)")
    add("--dry_run", action="store_true", default=False, help="print the settings and the command, start nothing")
    add(
        "--swap_trainer",
        action="store_true",
        default=False,
        help="run an unmodified transformers script with trainer_ext's Trainer and TrainingArguments in place of "
        "transformers' (no accelerate needed)",
    )
    return p


def split_argv(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], Target | None]:
    """Launcher options (names normalised to underscores) and the target with its own arguments."""
    takes_value = {s: a.nargs != 0 for a in parser._actions for s in a.option_strings}
    options: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word in ("-m", "--module"):
            if i + 1 >= len(argv):
                raise ConfigError("launch: -m needs a module name")
            return options, Target("module", argv[i + 1], list(argv[i + 2 :]))
        if word == "--":
            i += 1
            break
        if not word.startswith("-") or word == "-":
            break
        name, eq, value = word.partition("=")
        name = name if name in ("-h",) else "--" + name.lstrip("-").replace("-", "_")
        if name not in takes_value:
            valid = sorted({s for s in takes_value if s.startswith("--")})
            raise ConfigError(f"launch: unknown option {word.split('=')[0]}.{did_you_mean(name, valid)} ({USAGE})")
        options.append(name + eq + value)
        if takes_value[name] and not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"launch: {name} needs a value")
            options.append(argv[i + 1])
            i += 1
        i += 1
    if i >= len(argv):
        return options, None
    word, rest = argv[i], list(argv[i + 1 :])
    return options, Target("train" if word == "train" else "script", "trainer_ext" if word == "train" else word, rest)


def given_options(
    namespace: argparse.Namespace, options: Sequence[str], parser: argparse.ArgumentParser
) -> dict[str, tuple[Any, str]]:
    """The options given on the command line: name -> (value, the flag as typed)."""
    dest_of = {s: a.dest for a in parser._actions for s in a.option_strings}
    flags = {dest_of[w.split("=")[0]]: w.split("=")[0] for w in options if w.split("=")[0] in dest_of}
    skip = ("config_file", "dry_run", "swap_trainer")
    return {k: (v, flags.get(k, f"--{k}")) for k, v in vars(namespace).items() if v is not None and k not in skip}
