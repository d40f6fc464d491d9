"""Time to resume mid-epoch: from skipping k batches to holding the next batch, for early and late k.

    python benchmarks/resume.py [--samples 2000000] [--batch 8]

The sharded loader skips by index (no sample is loaded or collated); this shows that the cost does not
grow with the position: one pass of the epoch's shuffled index list, whatever k is.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from trainer_ext.distributed.accumulation import GradientState  # noqa: E402
from trainer_ext.distributed.data.loader import shard_dataloader, skip_first_batches  # noqa: E402


class Indices(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2_000_000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=2)
    opts = parser.parse_args(argv)
    loader = shard_dataloader(
        DataLoader(Indices(opts.samples), batch_size=opts.batch, shuffle=True),
        num_processes=opts.ranks,
        process_index=0,
        gradient_state=GradientState(),
        seed=0,
    )
    per_rank = len(loader)
    print(f"{opts.samples} samples, batch {opts.batch}, rank 0 of {opts.ranks}: {per_rank} batches per epoch")
    print(f"{'skip to batch':>14} {'time to next batch':>19}")
    for k in (10, per_rank // 100, per_rank // 2, per_rank - 10):
        skipped = skip_first_batches(loader, k)
        skipped.set_epoch(3)
        start = time.perf_counter()
        next(iter(skipped))
        print(f"{k:>14} {1000 * (time.perf_counter() - start):16.0f} ms")


if __name__ == "__main__":
    main()
