"""``trainer_ext.LocalSGD``: off on one process (there is nothing to average), as accelerate's is; on 2 gloo ranks
the weights drift apart and are averaged every K steps and on leaving the block. The accelerator parity scenario
``local_sgd`` compares it with accelerate's on 1 and 2 processes."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.ranks import run_ranks
from trainer_ext import Accelerator, LocalSGD


def test_one_process_trains_as_without_it():
    def run(with_local_sgd: bool) -> tuple[torch.Tensor, int]:
        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        local = LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=2, enabled=with_local_sgd)
        with local:
            for _ in range(5):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                local.step()
        assert local.enabled is False
        return model.weight.detach().clone(), local.num_steps

    with_it, steps = run(True)
    without, _ = run(False)
    assert steps == 5 and torch.equal(with_it, without)


@pytest.mark.distributed
def test_two_ranks_average_their_weights_every_k_steps_and_on_exit(tmp_path):
    run_ranks("tests.helpers.local_sgd_job", 2, str(tmp_path))
    result = json.loads((tmp_path / "result.json").read_text())
    # gradients are not all-reduced: the ranks drift apart, and are equal right after steps 3 and 6 (the averages)
    assert result["equal_after_step"] == [False, False, True, False, False, True, False]
    assert result["average_error"] < 1e-6  # each average is the mean of the ranks' weights
    assert result["equal_after_exit"] and result["exit_average_error"] < 1e-6 and result["steps"] == 7


@pytest.mark.distributed
def test_refused_under_fsdp_whose_parameters_are_sharded(tmp_path):
    run_ranks("tests.helpers.local_sgd_job", 1, str(tmp_path), "fsdp")
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["distributed_type"] == "DistributedType.FSDP" and result["type"] == "NotImplementedError"
    # accelerate's words first, then what to do
    assert result["message"].startswith("LocalSGD is supported only for CPUs and GPUs (no DeepSpeed or MegatronLM)")
    assert "use DDP" in result["message"]
