"""``trainer-ext plan``: the parallel layouts of a train job on given machines, ranked, with the command for each;
``--verify`` runs two real optimizer steps of the top ones and prints predicted against measured. See
docs/parallelism.md, "Choosing a layout"."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence
from typing import Any

from trainer_ext.cli.estimate import _process_count
from trainer_ext.errors import ConfigError
from trainer_ext.values import format_size

PLAN_FLAGS = (
    "num_machines",
    "gpus_per_machine",
    "num_processes",
    "device_memory",
    "host_memory",
    "interconnect",
    "global_batch_size",
    "top",
    "cpu",
    "json",
    "verify",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise ConfigError(f"plan: {message.removeprefix('argument ')}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trainer-ext plan",
        add_help=False,
        allow_abbrev=False,
        description="Rank the parallel layouts of `trainer-ext train` with the same flags on the given machines; "
        "every train flag is accepted (layout flags given fix that part of the layout).",
    )
    add = parser.add_argument
    add("-h", "--help", action="store_true", help="show this help and exit")
    add("--num_machines", type=_process_count, default=1, help="machines (default 1)")
    add("--gpus_per_machine", type=_process_count, default=None, help="devices (processes) on each machine")
    add(
        "--num_processes", type=_process_count, default=None, help="processes in total (instead of --gpus_per_machine)"
    )
    add("--device_memory", metavar="SIZE", help="memory of one device, e.g. 80GiB (default: this machine's GPU)")
    add(
        "--host_memory",
        metavar="SIZE",
        help="host memory of one machine, e.g. 512GiB: CPU offload must fit it (default: not checked)",
    )
    add("--interconnect", metavar="LINKS", help="links: 'within,between' machines, e.g. nvlink,ib (default)")
    add(
        "--global_batch_size",
        type=_process_count,
        default=None,
        help="sequences per optimizer step (default: the "
        "job's per_device_train_batch_size x gradient_accumulation_steps x processes)",
    )
    add("--top", type=_process_count, default=3, help="layouts to print (default 3)")
    add("--cpu", action="store_true", help="plan CPU processes (gloo) instead of GPUs")
    add("--json", nargs="?", const="-", metavar="FILE", help="write the plan as JSON (to FILE, or stdout)")
    add(
        "--verify",
        action="store_true",
        help="run two optimizer steps of the top layouts on this machine and "
        "print predicted against measured memory and communication",
    )
    return parser


def cluster_from(options: argparse.Namespace) -> Any:
    """The Cluster the options describe; one line when something is missing or does not add up."""
    from trainer_ext.estimate.startup import device_memory_bytes
    from trainer_ext.plan.cluster import Cluster, parse_interconnect

    machines = options.num_machines
    if options.gpus_per_machine and options.num_processes:
        if options.gpus_per_machine * machines != options.num_processes:
            raise ConfigError(
                f"--num_processes {options.num_processes} is not --num_machines {machines} x --gpus_per_machine "
                f"{options.gpus_per_machine}; give one of them"
            )
    per_machine = options.gpus_per_machine
    if per_machine is None and options.num_processes:
        if options.num_processes % machines:
            raise ConfigError(
                f"--num_processes {options.num_processes} does not split evenly over --num_machines {machines}; "
                "give a multiple of it, or --gpus_per_machine"
            )
        per_machine = options.num_processes // machines
    if per_machine is None:
        raise ConfigError("plan needs the devices: --gpus_per_machine N (with --num_machines M) or --num_processes N")
    device = "cpu" if options.cpu else "cuda"
    memory = device_memory_bytes(options.device_memory) if options.device_memory else 0
    if not memory and device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "plan needs --device_memory (e.g. 80GiB): this machine has no GPU to read it from; or --cpu to plan "
                "CPU processes"
            )
        memory = torch.cuda.get_device_properties(0).total_memory
    within, between = parse_interconnect(options.interconnect, machines, device)
    host = device_memory_bytes(options.host_memory, "--host_memory") if options.host_memory else 0
    return Cluster(machines, per_machine, memory, within, between, device, host)


def run_plan(argv: Sequence[str]) -> int:
    """Print the plan (and the verification); exit 0, 2 when no layout fits, 1 when a verification run failed."""
    from trainer_ext.plan.planner import make_plan, smallest_change
    from trainer_ext.plan.report import format_plan, plan_json

    parser = build_parser()
    options, train_argv = parser.parse_known_args(list(argv))
    if options.help:
        parser.print_help()
        return 0
    cluster = cluster_from(options)
    if options.verify and cluster.num_machines > 1:
        raise ConfigError("--verify runs the layouts on this machine; plan one machine (--num_machines 1) to verify")
    if options.json and options.json != "-":
        from trainer_ext.cli.estimate import check_json_target
        from trainer_ext.estimate.report import check_writable

        check_json_target(options.json)
        check_writable(options.json)  # before the plan and the verifying runs, not after
    plan = make_plan(train_argv, cluster, options.global_batch_size)
    if not plan.ranked:
        changes = smallest_change(train_argv, cluster, plan.global_batch, plan.job)
        what = "; or ".join(changes) if changes else "a smaller model"
        raise ConfigError(
            f"no layout fits {cluster.describe()}: the job needs more memory per device than any layout leaves; it "
            f"fits with {what}"
        )
    document = plan_json(plan, options.top)
    if options.json != "-":
        print(format_plan(plan, options.top))
    status = 0
    if options.verify:
        status, document["verified"] = verify(plan, options.top, quiet=options.json == "-")
    if options.json == "-":
        print(json.dumps(document, indent=2, sort_keys=True))
    elif options.json:
        from trainer_ext.cli.estimate import write_json_file

        write_json_file(options.json, document)
    return status


MEMORY_KEYS = ("weights", "gradients", "optimizer", "activations", "total")
SMALL = 0.01  # collectives the model leaves out (norms, logging, start-up broadcasts) stay under this share


def verify(plan: Any, top: int, quiet: bool = False) -> tuple[int, list[dict[str, Any]]]:
    """Two real optimizer steps of each of the top layouts on this machine's processes: predicted against measured
    per-rank memory and bytes per collective (status 1 when a run failed), printed unless ``quiet``."""
    from trainer_ext.cli.parallelism import _layout_flags
    from trainer_ext.estimate.fit import checkpointing_flag
    from trainer_ext.job.flags import parse_train_values
    from trainer_ext.plan.comms import by_collective, step_traffic
    from trainer_ext.plan.report import _without_layout
    from trainer_ext.plan.worker import measure_layout

    def say(text: str) -> None:
        if not quiet:
            print(text)

    _check_devices(plan, top)
    values = parse_train_values(plan.train_argv)[0]
    say("\nverify: two optimizer steps of each layout on this machine; the busiest rank, the second step")
    failed, results = 0, []
    for number, candidate in enumerate(plan.ranked[:top], 1):
        layout = candidate.layout
        argv = [*_without_layout(plan.train_argv), *_layout_flags(layout, values, checkpointing_flag())]
        say(f"{number}. {layout.name()}")
        if layout.family.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
            say("   skipped: deepspeed is not installed (pip install 'deepspeed>=0.16')")
            results.append({"layout": layout.name(), "skipped": "deepspeed is not installed"})
            continue
        try:
            measured = measure_layout(argv, layout.world, setup=candidate.setup)
        except RuntimeError as error:
            print(f"   error: {error}", file=sys.stderr)
            failed += 1
            results.append({"layout": layout.name(), "error": str(error)})
            continue
        memory = {key: [getattr(candidate.memory, key), int(measured.get(key, 0))] for key in MEMORY_KEYS}
        predicted = by_collective(step_traffic(plan.job.shape, candidate.setup))
        counted = {k: int(v) for k, v in measured.get("collectives", {}).items() if v and k != "recv"}
        everything = max(sum(counted.values()), 1)
        collectives = {
            kind: [predicted.get(kind, 0), counted.get(kind, 0)]
            for kind in sorted(set(predicted) | set(counted))
            if predicted.get(kind) or counted.get(kind, 0) >= SMALL * everything
        }
        small = sorted(kind for kind in counted if kind not in collectives)
        for key, (guess, real) in [*memory.items(), *collectives.items()]:
            say(_row(key, guess, real))
        if small:
            say(f"   not modelled (under 1 % of the bytes): {', '.join(small)}")
        results.append({"layout": layout.name(), "memory": memory, "collectives": collectives, "not_modelled": small})
    return (1 if failed else 0), results


def _check_devices(plan: Any, top: int) -> None:
    """Refuse, before any run, layouts with more processes than this machine's GPUs (on a GPU plan)."""
    if plan.cluster.device != "cuda":
        return
    import torch

    needed = max(candidate.layout.world for candidate in plan.ranked[:top])
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < needed:
        raise ConfigError(
            f"--verify runs each layout on this machine's GPUs: it needs {needed} and this machine has {have}; "
            "plan for this machine's GPUs, or add --cpu to verify on CPU processes"
        )


def _row(name: str, predicted: int, measured: int) -> str:
    error = f"{(predicted - measured) / measured:+.1%}" if measured else "n/a"
    return f"   {name:<16} predicted {format_size(int(predicted)):>11}  measured {format_size(int(measured)):>11}  {error}"
