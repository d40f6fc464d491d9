"""One rank of one phase of a scenario (started by ``run`` under ``torch.distributed.run``).

    python -m tests.accelerator_parity.worker --impl ours --scenario plain --phase run --processes 2 \
        --workdir W --outdir O

Writes ``O/rank{RANK}.json`` (and rank 0's tensors). ``ours`` hides accelerate from the import system first, as
where it is not installed; the record says whether it got imported anyway.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
from pathlib import Path

from tests.parity_harness.workload import die_with_launcher, leave_without_teardown, set_up


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=("stock", "ours"), required=True)
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--phase", required=True)
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--outdir", required=True)
    options = parser.parse_args(argv)
    faulthandler.register(signal.SIGTERM, chain=True)  # killed after a hang or a peer's crash: say where it was
    die_with_launcher()
    set_up(options.impl)
    import torch

    from . import scenarios_data, scenarios_deepspeed, scenarios_fsdp, scenarios_misc, scenarios_train
    from .api import Api
    from .workload import Context, Recorder, error

    torch.set_num_threads(1)
    outdir = Path(options.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    recorder = Recorder(int(os.environ.get("RANK", "0")), outdir, Path(options.workdir))
    modules = (scenarios_train, scenarios_data, scenarios_misc, scenarios_deepspeed, scenarios_fsdp)
    script = next(getattr(m, options.scenario) for m in modules if hasattr(m, options.scenario))
    try:
        api = Api(options.impl)
        recorder.put("set_seed_from", api.set_seed_from)
        script(Context(api, options.phase, options.processes, Path(options.workdir), recorder))
    except Exception as exc:  # what the script observed last; the comparison reports it
        recorder.data["error"] = error(exc)
    recorder.data["meta"] = {name: name in sys.modules for name in ("accelerate", "peft", "trainer_ext")}
    recorder.data["meta"]["returned"] = True  # the script ran to its end (or raised): not stuck in it
    recorder.write()
    if options.impl == "stock":
        leave_without_teardown()  # accelerate's gloo teardown aborts now and then; everything is recorded by now
    return 0


if __name__ == "__main__":
    sys.exit(main())
