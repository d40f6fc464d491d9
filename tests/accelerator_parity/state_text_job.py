"""What ``print(accelerator.state)`` and accelerate.utils' helpers show on each rank, stock or ours: the job of
``test_utility_names.py``.

    python [-m torch.distributed.run --standalone --nproc_per_node N] -m tests.accelerator_parity.state_text_job \\
        stock|ours OUT

``ours`` runs with accelerate hidden from the import system. Rank N writes ``OUT/rankN.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.parity_harness.workload import hide_accelerate, quiet_and_deterministic


def main(impl: str, out: Path) -> None:
    quiet_and_deterministic()
    if impl == "ours":
        hide_accelerate()
        from trainer_ext import Accelerator, DistState, gather_object

        def process_state() -> object:
            return DistState(cpu=True)
    else:
        from accelerate import Accelerator, PartialState
        from accelerate.utils import gather_object

        process_state = PartialState
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    rank = accelerator.process_index
    seen = {
        "accelerator_state": str(accelerator.state),
        "process_state": str(process_state()),
        "gather_object": gather_object([f"rank{rank}", rank]),
        "accelerate_imported": "accelerate" in sys.modules,
    }
    accelerator.wait_for_everyone()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
