"""``LocalSGD(local_sgd_steps=3)`` on every rank of a launch, each rank on its own data: rank 0 writes, after each
optimizer step, whether the ranks' weights are equal, and the mean of the ranks' weights just before each average.

``python -m tests.helpers.local_sgd_job OUT`` under torchrun; ``OUT fsdp`` instead writes the error LocalSGD raises
on an FSDP2 Accelerator (one launched process is enough for a sharded model).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers.tiny import tiny_llama
from trainer_ext import Accelerator, LocalSGD


def gathered(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every rank's flattened weights."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


def refused_under_fsdp(out: Path) -> None:
    accelerator = Accelerator(cpu=True, fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    model = accelerator.prepare(tiny_llama())
    try:
        LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=2)
    except NotImplementedError as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
    else:
        error = {"type": None, "message": ""}
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps({"distributed_type": str(accelerator.distributed_type), **error}))
    accelerator.end_training()


def main() -> None:
    out = Path(sys.argv[1])
    if sys.argv[2:] == ["fsdp"]:
        refused_under_fsdp(out)
        return
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(100 + accelerator.process_index)  # each rank its own data
    equal_after_step, expected_means, averaged = [], [], []
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=3) as local:
        for step in range(1, 8):
            x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            if step % 3 == 0:  # the mean LocalSGD is about to take
                expected_means.append(torch.stack(gathered(model)).mean(0))
            local.step()
            weights = gathered(model)
            equal_after_step.append(all(torch.equal(weights[0], w) for w in weights[1:]))
            if step % 3 == 0:
                averaged.append(weights[0])
        before_exit = torch.stack(gathered(model)).mean(0)
    after_exit = gathered(model)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        result = {
            "equal_after_step": equal_after_step,
            "average_error": max(float((a - e).abs().max()) for a, e in zip(averaged, expected_means, strict=True)),
            "equal_after_exit": all(torch.equal(after_exit[0], w) for w in after_exit[1:]),
            "exit_average_error": float((after_exit[0] - before_exit).abs().max()),
            "steps": local.num_steps,
        }
        (out / "result.json").write_text(json.dumps(result))
    accelerator.end_training()


if __name__ == "__main__":
    main()
