"""The self-test run in every process that ``trainer-ext test`` starts: collectives, then a few training steps.

``python -m trainer_ext.cli.selftest_worker --timeout S`` (under the launcher). Rank 0 prints one
PASS/FAIL line per check with what every rank saw, and a diagnosis when one fails. A collective that
cannot complete (a rank that never arrives) fails after S seconds instead of hanging, and ends the test.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer_ext.distributed import collectives
from trainer_ext.distributed.engine import Engine
from trainer_ext.distributed.state import DistState

STEPS, PER_RANK, SEQ_LEN, VOCAB, LR = 3, 2, 12, 64, 0.5
Check = Callable[[DistState, float], tuple[bool, str]]


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """A 2-layer Llama (hidden size 32) with weights fixed by ``seed``; built from a config, no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
    )
    return LlamaForCausalLM(config)


def global_batches(world: int) -> list[torch.Tensor]:
    """``STEPS`` batches of ``PER_RANK * world`` token sequences, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (PER_RANK * world, SEQ_LEN), generator=g) for _ in range(STEPS)]


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def check_all_reduce(state: DistState, timeout: float) -> tuple[bool, str]:
    world = state.num_processes
    total = collectives.reduce(torch.tensor([state.process_index + 1.0], device=state.device))
    expected = world * (world + 1) / 2
    return total.item() == expected, f"sum of (rank + 1) over {world} ranks = {total.item():g} (expected {expected:g})"


def check_broadcast(state: DistState, timeout: float) -> tuple[bool, str]:
    expected = torch.randn(8, generator=torch.Generator().manual_seed(1234))
    tensor = (expected.clone() if state.is_main_process else torch.zeros(8)).to(state.device)
    collectives.broadcast(tensor, from_process=0)
    ok = torch.equal(tensor.cpu(), expected)
    return ok, "rank 0's tensor arrived intact" if ok else "received tensor differs from rank 0's"


def check_barrier(state: DistState, timeout: float) -> tuple[bool, str]:
    if state.num_processes == 1:
        return True, "one process: nothing to wait for"
    start = time.monotonic()
    # monitored_barrier (gloo) names the ranks that did not arrive, where a plain barrier would just hang
    group = None if state.backend == "gloo" else dist.new_group(backend="gloo")
    dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout), wait_all_ranks=True)
    state.wait_for_everyone()
    return True, f"all {state.num_processes} ranks met in {time.monotonic() - start:.2f} s"


def check_gather(state: DistState, timeout: float) -> tuple[bool, str]:
    world = state.num_processes
    ranks = collectives.gather(torch.tensor([state.process_index], device=state.device)).tolist()
    info = collectives.gather_object([(state.process_index, socket.gethostname(), str(state.device))])
    hosts = sorted({host for _, host, _ in info})
    devices = ", ".join(f"{r}:{d}" for r, _, d in info)
    ok = ranks == list(range(world)) and [r for r, _, _ in info] == ranks
    return ok, f"ranks {ranks} on {len(hosts)} host(s) ({', '.join(hosts)}); devices {devices}"


def check_training(state: DistState, timeout: float) -> tuple[bool, str]:
    """A few SGD steps, data parallel through our engine, against one process on the whole batch (rank 0)."""
    rank, world, device = state.process_index, state.num_processes, state.device
    batches = global_batches(world)
    engine = Engine(state)
    model = tiny_llama(0)
    model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    for batch in batches:
        shard = batch[rank * PER_RANK : (rank + 1) * PER_RANK].to(device)
        engine.backward(model(input_ids=shard, labels=shard).loss)
        optimizer.step()
        optimizer.zero_grad()
    weights = _flat(engine.unwrap_model(model))
    from_rank0 = collectives.broadcast(weights.clone(), from_process=0)
    spread = (weights - from_rank0).abs().max().item()
    detail = f"replica differs from rank 0 by {spread:.1e}"
    ok = spread == 0.0
    if rank == 0:
        reference = tiny_llama(0).to(device)
        sgd = torch.optim.SGD(reference.parameters(), lr=LR)
        for batch in batches:
            batch = batch.to(device)
            reference(input_ids=batch, labels=batch).loss.backward()
            sgd.step()
            sgd.zero_grad()
        error = (weights - _flat(reference)).abs().max().item()
        ok = ok and error < 1e-4
        detail = f"{STEPS} steps on {world} rank(s) vs 1 process on the whole batch: max |difference| {error:.1e}"
    return ok, detail


CHECKS: list[tuple[str, Check]] = [
    ("all_reduce", check_all_reduce),
    ("broadcast", check_broadcast),
    ("barrier", check_barrier),
    ("gather", check_gather),
    ("training", check_training),
]


def diagnose(error: BaseException, timeout: float) -> str:
    """What a failed collective most likely means."""
    text = " ".join(str(error).split())
    missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
    if missing:
        return (
            f"rank(s) {missing.group(1).strip()} never arrived within {timeout:g} s: those processes are stuck (e.g. in "
            "a collective or barrier only some ranks call, or waiting for data) or died; their output above says which"
        )
    if re.search(r"timed? ?out", text, re.IGNORECASE):
        return (
            f"a collective did not complete within {timeout:g} s: some rank never called it, or the network between "
            "machines is blocked (firewall; choose the interface with GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)"
        )
    if re.search(r"connection (closed|reset)|broken pipe", text, re.IGNORECASE):
        return "another rank died during the collective; its own error is printed above"
    return f"{type(error).__name__}: {text}"


def run_checks(state: DistState, timeout: float, hang_rank: int | None = None) -> bool:
    """Run every check; rank 0 prints the combined result. False as soon as a check fails."""
    rank, passed = state.process_index, True
    for i, (name, check) in enumerate(CHECKS):
        if name == "barrier" and rank == hang_rank:
            time.sleep(10 * timeout)  # --simulate_hang: this rank never arrives (the launcher stops it)
        try:
            ok, detail = check(state, timeout)
        except Exception as error:  # a failed collective leaves the process group unusable: stop here
            who = f"[rank {rank}] " if rank else ""
            print(f"FAIL {name:<11} {who}{diagnose(error, timeout)}", flush=True)
            print(f"SKIP {', '.join(n for n, _ in CHECKS[i + 1 :]) or '-'} (after a failed collective)", flush=True)
            return False
        results = collectives.gather_object([(rank, ok, detail)])
        bad = [(r, d) for r, good, d in results if not good]
        passed = passed and not bad
        if rank == 0:
            line = "; ".join(f"rank {r}: {d}" for r, d in bad) if bad else detail
            print(f"{'PASS' if not bad else 'FAIL'} {name:<11} {line}", flush=True)
    return passed


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point in each process; exit code 0 when every check passed."""
    parser = argparse.ArgumentParser(prog="trainer_ext.cli.selftest_worker")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--simulate_hang", type=int, default=None, help="testing: this rank skips the barrier")
    args = parser.parse_args(argv)
    state = DistState(timeout=timedelta(seconds=args.timeout))
    if state.is_main_process:
        t = state.topology
        print(
            f"self-test: {t.world_size} process(es) on {t.num_nodes} machine(s), {state.device.type}, "
            f"backend {state.backend if t.world_size > 1 else '-'}, timeout {args.timeout:g} s",
            flush=True,
        )
    passed = run_checks(state, args.timeout, args.simulate_hang)
    if not passed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # peers may be gone: skip the teardown barrier that would wait for them
    state.destroy()
    if state.is_main_process:
        print(f"self-test: all {len(CHECKS)} checks passed", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
