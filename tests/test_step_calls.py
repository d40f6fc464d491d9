"""The benchmark's call counter (benchmarks/step_calls.py) on a real gloo group of one process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.step_calls import CallCounter


def test_counts_each_collective_once_and_only_between_the_warmup_and_the_last_step():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    original, counter = dist.all_reduce, CallCounter()
    counter.install()
    assert dist.all_reduce is not original
    try:
        x = torch.ones(4)
        out = torch.empty(4)
        dist.all_reduce(x)  # before the warm-up ends: not counted
        counter.on_tick(1, warmup=1)  # the warm-up's last step: counting starts
        for step in (2, 3):
            dist.all_reduce(x)
            dist.all_gather_into_tensor(out, x)  # goes through all_gather_single: counted once
            x.sum().item()
            counter.on_tick(step, warmup=1)
        dist.barrier()  # after the last step (teardown): not in the per-step figures
    finally:
        counter.uninstall()
        dist.destroy_process_group()
    assert counter.per_step() == {"all_reduce": 1.0, "all_gather_into_tensor": 1.0, "item (cpu)": 1.0}
    assert dist.all_reduce is original  # uninstalled
