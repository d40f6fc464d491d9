"""Framework overhead of the Trainer: the plain PyTorch loop against trainer_ext.Trainer (and the stock one).

    python benchmarks/overhead.py [--config tiny] [--steps N] [--repeats R] [--json out.json]

A shortcut for ``python -m benchmarks.run --runners plain,plain-hf,trainer,stock-trainer``; see benchmarks/run.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.run import main  # noqa: E402

if __name__ == "__main__":
    main(["--runners", "plain,plain-hf,trainer,stock-trainer", *sys.argv[1:]])
