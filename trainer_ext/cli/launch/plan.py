"""The plan of a launch: the exact command, the variables it adds to the environment, and the dry-run report.

Several processes, one with ``--max_restarts``, or one that runs FSDP (its device mesh needs a process group, of
world size 1), go through ``torch.distributed.run``: one machine meets on loopback (c10d, a free port), several at
the main address. One process otherwise is started directly.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass

from trainer_ext import env_vars
from trainer_ext.cli.launch.auto import resolve_auto
from trainer_ext.cli.launch.fsdp import FSDPPreview, preview_fsdp, runs_fsdp, script_fsdp
from trainer_ext.cli.launch.handoff import (
    DeepSpeedPreview,
    preview_deepspeed,
    translate_for_script,
    translate_for_train,
)
from trainer_ext.cli.launch.parallel import ParallelPlan, plan_for_script, plan_for_train
from trainer_ext.cli.launch.settings import Settings, loopback_rendezvous
from trainer_ext.cli.launch.target import Target
from trainer_ext.distributed import cpu_threads

RDZV_ID = "trainer_ext"


@dataclass
class Plan:
    """The exact command, the variables it adds to the environment, and what the dry run should say."""

    command: list[str]
    env: dict[str, str]
    torchrun_args: list[str] | None
    notes: list[str]
    deepspeed: DeepSpeedPreview | None = None
    fsdp: FSDPPreview | None = None
    parallel: ParallelPlan | None = None


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


def _thread_env(s: Settings) -> dict[str, str]:
    """OMP_NUM_THREADS (and on CPU the OpenMP wait policy) of each process, where the user set none: CPU processes
    share the idle cores (``trainer_ext.distributed.cpu_threads``); a GPU process gets 1, as under torchrun and accelerate."""
    given = s["num_cpu_threads_per_process"]
    env: dict[str, str] = {}
    if given:
        env = {cpu_threads.NUM_THREADS: str(given), cpu_threads.SOURCE: "flag"}
    elif cpu_threads.NUM_THREADS in os.environ:  # the user's value reaches every process as it is
        pass
    elif s["device"] == "cuda":
        env = {cpu_threads.NUM_THREADS: "1", cpu_threads.SOURCE: "gpu"}
    else:
        policy = cpu_threads.choose(int(s["nproc_per_node"] or 1), env={})
        env = {cpu_threads.NUM_THREADS: str(policy.threads), cpu_threads.SOURCE: "policy"}
    if s["device"] != "cuda" and cpu_threads.WAIT_POLICY not in os.environ:
        env[cpu_threads.WAIT_POLICY] = cpu_threads.DEFAULT_WAIT_POLICY
    return env


def build_plan(s: Settings, target: Target, strategy: bool = True) -> Plan:
    """The command and environment for ``target`` under settings ``s`` (``strategy=False``: DDP only)."""
    notes: list[str] = []
    if target.kind == "train" and target.swap:
        notes.append("--swap_trainer changes nothing for train: it runs trainer_ext's Trainer already")
    deepspeed = fsdp = parallel = None
    if target.kind == "train":
        user_args = target.args
        parallel = plan_for_train(s, user_args) if strategy else None
        target, env = translate_for_train(s, target, notes, strategy)
        if parallel is not None:
            target = Target(target.kind, target.name, [*target.args, *parallel.train_flags])
        if strategy:
            auto = resolve_auto(s, target, notes, parallel)
            if auto is not None:  # the plan's layout replaces the job's (the launch's layout settings included)
                target, parallel, auto_env = auto
                user_args = target.args
                env.update(auto_env)
            deepspeed = preview_deepspeed(s, user_args, target.args)
            notes += deepspeed.notes if deepspeed else []
            fsdp = preview_fsdp(s, user_args, target.args)
            notes += fsdp.notes if fsdp else []
    else:
        env = translate_for_script(s, target, notes, strategy)
        fsdp = script_fsdp(s) if strategy else None
        parallel = plan_for_script(s) if strategy else None
        if fsdp is not None:
            env[env_vars.FSDP_CONFIG] = fsdp.exported()
    if parallel is not None:
        env.update(parallel.env())
        notes += parallel.notes
    if s["device"] == "cuda" and s.given("gpu_ids") and s["gpu_ids"] != "all":
        env[env_vars.CUDA_VISIBLE_DEVICES] = s["gpu_ids"]
    env.update(_thread_env(s))
    if s["debug"]:
        env[env_vars.TORCH_DISTRIBUTED_DEBUG] = "DETAIL"
    if int(s["max_restarts"] or 0) > 0:
        # restarted workers otherwise reuse the agent's store and look up the dead attempt's addresses
        env.setdefault(env_vars.TORCH_DISABLE_SHARE_RDZV_TCP_STORE, "1")
    if s.world_size == 1 and not s["max_restarts"]:
        if not runs_fsdp(target, fsdp):
            return Plan([sys.executable, "-u", *target.python_argv()], env, None, notes, deepspeed, fsdp, parallel)
        loopback_rendezvous(s, "FSDP on one process needs a process group")
        notes.append("FSDP on one process: started through torch.distributed.run, for a process group of one")
    torchrun = ["--nnodes", str(s["num_machines"]), "--nproc_per_node", str(s["nproc_per_node"])]
    torchrun += rendezvous_args(s) + ["--max_restarts", str(s["max_restarts"])] + target.python_argv()
    command = [sys.executable, "-m", "torch.distributed.run", *torchrun]
    return Plan(command, env, torchrun, notes, deepspeed, fsdp, parallel)


def describe(settings: Settings, plan: Plan) -> str:
    """The dry-run report: settings with sources, notes, and the exact command."""
    lines = [f"config file: {settings.config_file}", "resolved launch settings (value, then where it came from):"]
    lines.append(settings.table())
    if plan.parallel is not None:
        lines.append(plan.parallel.line())
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
