"""``trainer-ext launch``: run a script, a module or ``train`` on 1..N processes and 1..M machines.

Several processes go through ``torch.distributed.run`` (called as a library), and so does one process
with ``--max_restarts`` (torchrun's agent restarts it; the rendezvous stays on loopback); one process
otherwise is started directly, with no rendezvous and no torch.distributed variables. Settings come from
the command line, then the config file, then defaults (see :mod:`.launch_settings`); everything that can
be checked is checked before a process starts (the DeepSpeed or FSDP config of ``train`` included), and
``--dry_run`` shows the result with its sources and the DeepSpeed config or FSDP settings as ``train`` will
resolve them.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import ipaddress
import json
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError, did_you_mean
from .launch_config import MIXED_PRECISION, RDZV_BACKENDS, find_config_file, one_of, read_config_file
from .launch_fsdp import FSDPPreview, preview_fsdp
from .launch_settings import Settings, resolve
from .launch_train_args import (
    DeepSpeedPreview,
    preview_deepspeed,
    strategy_problems,
    translate_for_script,
    translate_for_train,
)

USAGE = "trainer-ext launch [options] (SCRIPT.py | -m MODULE | train) [args...]"
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
RDZV_ID = "trainer_ext"


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
    add("--deepspeed", metavar="CONFIG", help="DeepSpeed JSON, passed to train as --deepspeed")
    add("--fsdp_config", metavar="CONFIG", help="FSDP config, passed to train as --fsdp full_shard --fsdp_config")
    add("--debug", action="store_const", const=True, help="TORCH_DISTRIBUTED_DEBUG=DETAIL in every process")
    add("--config_file", metavar="FILE", help="launch config (default: $TRAINER_EXT_CONFIG_FILE or ~/.cache/...)")
    add("--dry_run", action="store_true", default=False, help="print the settings and the command, start nothing")
    return p


@dataclass
class Target:
    """What to run: ``train`` (``python -m trainer_ext train``), a script, or a module, with its arguments."""

    kind: str
    name: str
    args: list[str] = field(default_factory=list)

    def python_argv(self) -> list[str]:
        if self.kind == "script":
            return [self.name, *self.args]
        if self.kind == "train":
            return ["-m", "trainer_ext", "train", *self.args]
        return ["-m", self.name, *self.args]


@dataclass
class Plan:
    """The exact command, the variables it adds to the environment, and what the dry run should say."""

    command: list[str]
    env: dict[str, str]
    torchrun_args: list[str] | None
    notes: list[str]
    deepspeed: DeepSpeedPreview | None = None
    fsdp: FSDPPreview | None = None


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


def _given(namespace: argparse.Namespace, options: Sequence[str], parser: argparse.ArgumentParser) -> dict:
    """The options given on the command line: name -> (value, the flag as typed)."""
    dest_of = {s: a.dest for a in parser._actions for s in a.option_strings}
    flags = {dest_of[w.split("=")[0]]: w.split("=")[0] for w in options if w.split("=")[0] in dest_of}
    skip = ("config_file", "dry_run")
    return {k: (v, flags.get(k, f"--{k}")) for k, v in vars(namespace).items() if v is not None and k not in skip}


def target_problems(target: Target | None) -> list[str]:
    """A missing script or an unimportable module, found before any process starts."""
    if target is None:
        return [f"nothing to launch: give SCRIPT.py, -m MODULE or train ({USAGE})"]
    if target.kind == "script" and not os.path.isfile(target.name):
        return [f"script {target.name!r} not found (working directory {os.getcwd()})"]
    if target.kind == "module":
        sys.path.insert(0, os.getcwd())  # `python -m` in the processes finds modules in the working directory
        try:
            found = importlib.util.find_spec(target.name) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.remove(os.getcwd())
        if not found:
            return [f"module {target.name!r} not found: `python -m {target.name}` would fail (is it installed?)"]
    return []


def port_problem(host: str, port: int) -> str | None:
    """'port in use' when ``port`` cannot be bound here; None when free or when ``host`` is another machine."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, 0))  # is the address one of this machine's?
        except OSError:
            return None
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("::" if family == socket.AF_INET6 else "", port))  # torch's store listens on all interfaces
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return f"port {port} is already in use on this machine; pick another --main_process_port"
            return f"port {port} cannot be opened: {error.strerror}"
    return None


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def rendezvous_args(s: Settings) -> list[str]:
    """torchrun's rendezvous options: c10d on loopback for one machine, the main address for several."""
    host, port, backend = s["main_process_ip"], s["main_process_port"], s["rdzv_backend"]
    timeout = s["rdzv_timeout"]
    if backend == "static":
        args = ["--rdzv_backend", "static", "--node_rank", str(s["machine_rank"])]
        args += ["--master_addr", host, "--master_port", str(port)]
        return args + (["--rdzv_conf", f"timeout={timeout}"] if timeout else [])
    args = ["--rdzv_backend", backend, "--rdzv_endpoint", _endpoint(host, port), "--rdzv_id", RDZV_ID]
    if s["num_machines"] == 1:
        args += ["--local_addr", "127.0.0.1"]  # the processes' MASTER_ADDR: loopback, not the host name
    return args + (["--rdzv_conf", f"join_timeout={timeout}"] if timeout else [])


def build_plan(s: Settings, target: Target, strategy: bool = True) -> Plan:
    """The command and environment for ``target`` under settings ``s`` (``strategy=False``: DDP only)."""
    notes: list[str] = []
    deepspeed = fsdp = None
    if target.kind == "train":
        user_args = target.args
        target, env = translate_for_train(s, target, notes, strategy)
        if strategy:
            deepspeed = preview_deepspeed(s, user_args, target.args)
            notes += deepspeed.notes if deepspeed else []
            fsdp = preview_fsdp(s, user_args, target.args)
            notes += fsdp.notes if fsdp else []
    else:
        env = translate_for_script(s, target, notes, strategy)
    if s["device"] == "cuda" and s.given("gpu_ids") and s["gpu_ids"] != "all":
        env["CUDA_VISIBLE_DEVICES"] = s["gpu_ids"]
    if s["debug"]:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    if int(s["max_restarts"] or 0) > 0:
        # restarted workers otherwise reuse the agent's store and look up the dead attempt's addresses
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if s.world_size == 1 and not s["max_restarts"]:
        return Plan([sys.executable, "-u", *target.python_argv()], env, None, notes, deepspeed, fsdp)
    torchrun = ["--nnodes", str(s["num_machines"]), "--nproc_per_node", str(s["nproc_per_node"])]
    torchrun += rendezvous_args(s) + ["--max_restarts", str(s["max_restarts"])]
    if target.kind == "script":
        torchrun += [target.name, *target.args]
    else:
        torchrun += target.python_argv()
    return Plan([sys.executable, "-m", "torch.distributed.run", *torchrun], env, torchrun, notes, deepspeed, fsdp)


def prepare(argv: Sequence[str], strategy: bool = True) -> tuple[Settings, Plan, bool]:
    """Parse, resolve and check ``argv`` into (settings, plan, dry_run); ConfigError listing every problem."""
    parser = build_parser()
    options, target = split_argv(argv, parser)
    if "-h" in options or "--help" in options:
        parser.print_help()
        raise SystemExit(0)
    namespace = parser.parse_args(options)
    path, how = find_config_file(namespace.config_file)
    config = read_config_file(path) if path is not None else None
    if config is not None:
        _say(f"launch config: {path} ({how})")
        if config.ignored:
            _say(f"warning: ignored accelerate keys (no effect here): {', '.join(config.ignored)}")
    settings = resolve(_given(namespace, options, parser), config)
    settings.config_file = f"{path} ({how})" if path is not None else how
    problems = (config.problems if config else []) + settings.problems + target_problems(target)
    problems += strategy_problems(settings, target, strategy)
    if not problems:
        problems += _port_problems(settings)
    plan = None
    if not problems:
        try:  # builds the train arguments and resolves their DeepSpeed config: its errors are launch problems too
            plan = build_plan(settings, target, strategy)
        except ConfigError as error:
            problems.append(str(error).replace("\n", "\n    "))
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"cannot launch ({len(problems)} problem{'s' * (len(problems) > 1)}):\n{listed}")
    return settings, plan, namespace.dry_run


def _port_problems(s: Settings) -> list[str]:
    """The rendezvous port must be free where this launcher will open it.

    That is the only machine, machine 0 of a static rendezvous, and under c10d the machine whose address is
    main_process_ip (torch hosts the store there; on a busy port it would join whatever listens instead).
    """
    port, host, backend = s["main_process_port"], s["main_process_ip"], s["rdzv_backend"]
    if not port or host is None or backend not in ("static", "c10d"):
        return []  # a free port chosen at start, no rendezvous, or an external etcd server
    several = s["num_machines"] > 1
    if several and backend == "static" and s["machine_rank"] != 0:
        return []  # connects to machine 0
    problem = port_problem(host, port)
    if problem is None:
        return []
    if several and backend == "c10d":
        if _is_loopback(host):  # every machine of the job is on this host: the store may be another one's
            s.notes.append(
                f"port {port} on {host} is already in use: fine if another machine of this job (started on this "
                "same host) hosts the rendezvous there; otherwise pick another --main_process_port"
            )
            return []
        problem += (
            f" (the c10d rendezvous store is hosted here, at main_process_ip {host}; several launchers of one job "
            "on this same host meet on main_process_ip 127.0.0.1)"
        )
    return [problem]


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # another host name
        return False


def _say(text: str) -> None:
    print(f"trainer-ext launch: {text}", file=sys.stderr, flush=True)


def describe(settings: Settings, plan: Plan) -> str:
    """The dry-run report: settings with sources, notes, and the exact command."""
    lines = [f"config file: {settings.config_file}", "resolved launch settings (value, then where it came from):"]
    lines.append(settings.table())
    if plan.deepspeed is not None:
        lines += _describe_deepspeed(plan.deepspeed)
    if plan.fsdp is not None:
        lines += plan.fsdp.lines()
    notes = settings.notes + plan.notes
    if notes:
        lines += ["notes:"] + [f"  - {n}" for n in notes]
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env.items())
    lines += ["command:", "  " + (prefix + " " if prefix else "") + shlex.join(plan.command)]
    return "\n".join(lines)


def _describe_deepspeed(preview: DeepSpeedPreview) -> list[str]:
    """The DeepSpeed config as ``train`` will start with it, and the values its ``"auto"`` keys took."""
    lines = [f'DeepSpeed config {preview.source}, "auto" values resolved from the launch and train arguments:']
    lines += ["  " + line for line in json.dumps(preview.config, indent=2).splitlines()]
    return lines + ["  resolved from:"] + [f"    {line}" for line in preview.inputs]


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def execute(plan: Plan) -> int:
    """Run the plan; return the exit code of the (first failed) process."""
    if plan.torchrun_args is None:
        env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
        return subprocess.run(plan.command, env={**env, **plan.env}).returncode
    from .launch_run import run_torchrun

    with _environment(plan.env):
        return run_torchrun(plan.torchrun_args)


def run_launch(argv: Sequence[str]) -> int:
    """``trainer-ext launch``: print the dry run or start the processes."""
    settings, plan, dry_run = prepare(argv)
    if dry_run:
        print(describe(settings, plan))
        return 0
    for note in settings.notes + plan.notes:
        _say(f"note: {note}")
    machines = settings["num_machines"]
    where = f"{machines} machines ({settings['nproc_per_node']} here)" if machines > 1 else "this machine"
    _say(f"{settings.world_size} process{'es' * (settings.world_size > 1)} on {where}, {settings['device']}")
    return execute(plan)
