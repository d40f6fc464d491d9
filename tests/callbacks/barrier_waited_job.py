"""One rank leaves before a barrier; the other reports how long it actually waited.

``python -m tests.callbacks.barrier_waited_job OUT GONE`` on 2 gloo ranks: rank GONE leaves the job (its process
ends) right after a first barrier; the other waits at BarrierCallback's barrier (timeout 600 s) and writes the
BarrierTimeoutError it gets to ``OUT/error<rank>.txt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

from trainer_ext.callbacks import BarrierCallback, BarrierTimeoutError


def main(out: Path, gone: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    if rank == gone:
        os._exit(0)  # leaves: its connections close, as a crashed rank's do
    try:
        BarrierCallback(timeout=600).wait("before checkpoint save at step 7", None)
        text = "no error"
    except BarrierTimeoutError as error:
        text = str(error)
    (out / f"error{rank}.txt").write_text(text)
    os._exit(0)  # the group lost a member: no orderly destroy


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
