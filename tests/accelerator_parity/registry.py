"""The scenarios, as plain data (listing them imports neither torch nor an implementation).

Each scenario is a function of the same name in ``scenarios_train``, ``scenarios_data`` or ``scenarios_misc``; a run
plays its phases in order, each phase a fresh launch of every rank (a resumed run is a new process, as after a real interruption).
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.parity_harness.registry import IMPLS

__all__ = ["ALL_NPROCS", "CASES", "IMPLS", "NPROCS", "SCENARIOS", "Spec"]
NPROCS = (1, 2)


@dataclass(frozen=True)
class Spec:
    """``phases``: played by both implementations; ``ours_only``: phases that only trainer_ext can play;
    ``nprocs``: the process counts it runs on."""

    phases: tuple[str, ...] = ("run",)
    ours_only: tuple[str, ...] = ()
    nprocs: tuple[int, ...] = NPROCS

    def phases_for(self, impl: str) -> tuple[str, ...]:
        return self.phases + (self.ours_only if impl == "ours" else ())


RESUME = ("full", "interrupted", "resumed")

SCENARIOS: dict[str, Spec] = {
    "plain": Spec(),
    "accumulation": Spec(),
    "resume_accelerate_style": Spec(RESUME),
    "resume_ours_style": Spec(("full",), ours_only=("interrupted", "resumed", "resumed_skip_by_hand")),
    "checkpoint_rotation": Spec(),
    "trackers": Spec(),
    "split_between_processes": Spec(),
    "uneven_eval": Spec(("even_batches", "uneven_batches")),
    "join_uneven_inputs": Spec(("dataloader_config", "override")),
    "save_model": Spec(),
    "kwargs_handlers": Spec(),
    "memory_example": Spec(),
    "local_sgd": Spec(),
    "iterable_dataset": Spec(("dispatch", "read_by_every_rank")),
    "split_batches": Spec(),
    "dispatch_batches": Spec(),
    "shuffle_drop_last": Spec(nprocs=(1, 2, 3)),
    "resume_iterable": Spec(RESUME, ours_only=("resumed_by_load_state",)),
    "resume_iterable_read_by_every_rank": Spec(RESUME, ours_only=("resumed_by_load_state",)),
    "deepspeed_config_support": Spec(("config_blocks", "torch_objects")),
    "fsdp_plugin": Spec(("full_shard", "shard_grad_op")),
}

CASES = [(name, nproc) for name, spec in SCENARIOS.items() for nproc in spec.nprocs]
ALL_NPROCS = tuple(sorted({nproc for _, nproc in CASES}))
