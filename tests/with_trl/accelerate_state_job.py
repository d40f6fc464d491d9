"""Rank job: after our Trainer is built, accelerate's free functions (which TRL calls directly) see our processes.

python -m torch.distributed.run --nproc_per_node 2 -m tests.with_trl.accelerate_state_job OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate.logging import get_logger
from accelerate.utils import broadcast_object_list, gather, gather_object, set_seed

from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer, TrainingArguments


def main(out: Path, early: bool) -> None:
    if early:
        from accelerate.state import PartialState

        assert PartialState().device.type == "cpu"
    args = TrainingArguments(output_dir=str(out / "run"), report_to="none", max_steps=1, per_device_train_batch_size=2)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=lm_dataset(8))
    rank = trainer.args.process_index
    set_seed(11, device_specific=True)  # GRPO's call: the seed plus this process's index
    seeded = torch.initial_seed()
    shared = [f"from rank {rank}"]
    broadcast_object_list(shared, from_process=0)
    get_logger(__name__).info("accelerate's logger works", main_process_only=True)  # refuses without a state
    result = {
        "gather": gather(torch.tensor([rank * 10.0, rank * 10.0 + 1])).tolist(),
        "gather_object": gather_object([rank]),
        "seeds": gather_object([seeded]),
        "broadcast": shared,
        "engine": type(trainer.accelerator).__name__,
    }
    if rank == 0:
        (out / "result.json").write_text(json.dumps(result))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] == ["early"])
