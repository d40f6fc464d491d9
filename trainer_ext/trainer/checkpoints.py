"""Trainer overrides that make checkpoints atomic, resume pick the newest complete one, and preemption save.

transformers writes ``checkpoint-N`` from several ranks and rotates before the other ranks have finished;
here every save is committed by a marker (sizes, checksums) written after a barrier, rotation runs after the
commit and counts only complete checkpoints, and resume verifies what it loads on every rank, which agree.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from trainer_ext.callbacks.duties import DutyCallbackHandler
from trainer_ext.checkpointing import disk_space, marker, selection
from trainer_ext.checkpointing import sharded as sharded_checkpoint
from trainer_ext.checkpointing.commit import commit
from trainer_ext.checkpointing.links import refuse_link, refuse_links_under
from trainer_ext.checkpointing.listing import rotate, sorted_checkpoints
from trainer_ext.checkpointing.preemption import DEFAULT_EXIT_CODE, Preempted, PreemptionCallback, WorkerInit
from trainer_ext.checkpointing.verification import check_safetensors
from trainer_ext.distributed.strategies import STRATEGIES, checkpoint_owner
from trainer_ext.errors import ConfigError

logger = logging.getLogger(__name__)

# what transformers' save_model, save_metrics and save_state write at the top of a folder (a final model's files)
SAVED_FILE = re.compile(
    r"(model|pytorch_model|adapter_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?|[\w.-]*config\.json|"
    r"tokenizer[\w.-]*|special_tokens_map\.json|added_tokens\.json|vocab\.\w+|merges\.txt|chat_template\.\w+|"
    r"training_args\.bin|[\w-]*results\.json|trainer_state\.json"
)


def refuse_saved_links(folder: str | os.PathLike) -> None:
    """The link rule for a final save: refuse (one line) a link in ``folder`` named like a file it writes."""
    if os.path.isdir(folder):
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if entry.is_symlink() and SAVED_FILE.fullmatch(entry.name):
                refuse_link(entry.path, "where the model and its results are saved")


def _barrier(trainer: Any) -> None:
    trainer.accelerator.state.wait_for_everyone()


class CheckpointingMixin:
    """Mix in before ``transformers.Trainer``: atomic checkpoints, verified resume, preemption."""

    _preemption: PreemptionCallback | None = None
    _resolved_resume: tuple[Any, str | None] | None = None  # (request, checkpoint) of the last resolve_resume

    def _install_preemption(self) -> PreemptionCallback | None:
        """The preemption handler when ``save_on_preemption`` is set (a duty, or the user's listed instance)."""
        handler = self.callback_handler
        found = handler.duty(PreemptionCallback) if isinstance(handler, DutyCallbackHandler) else None
        if (
            found is None
            and isinstance(handler, DutyCallbackHandler)
            and getattr(self.args, "save_on_preemption", False)
        ):
            grace = getattr(self.args, "preemption_grace_seconds", 30.0)
            every = getattr(self.args, "preemption_check_steps", None)
            found = PreemptionCallback(grace, every)
            handler.add_duty(found)
        self._preemption = found
        return found

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``train`` with ``True``/``"auto"``/``"latest"`` resolved to the newest complete checkpoint."""
        resume = self.resolve_resume(resume_from_checkpoint)
        self._resolved_resume = None  # a later train() looks again (new checkpoints may exist by then)
        preemption = self._install_preemption()
        limit = self.args.save_total_limit
        try:
            result = super().train(resume, *args, **kwargs)
        finally:
            self.args.save_total_limit = limit  # a preemption's save leaves it None until here (_save_checkpoint)
            if preemption is not None and preemption.preempted_at is None:
                preemption.flag.restore()  # also when train() raised: SIGTERM must kill the process again
        if preemption is not None and preemption.preempted_at is not None:
            code = getattr(self.args, "preemption_exit_code", DEFAULT_EXIT_CODE)
            logger.warning(
                "preempted: checkpoint-%d is saved; exiting with code %d (resume with --resume_from_checkpoint auto)",
                preemption.preempted_at,
                code,
            )
            raise Preempted(code)
        return result

    def resolve_resume(self, value: str | bool | None) -> str | None:
        """The checkpoint to resume from: ``True``/"true"/"latest" = the newest complete one (ValueError if none),
        ``"auto"`` = the same or None, a path = that checkpoint, verified (ValueError when it does not exist).

        The answer is kept: asked again with the same request or its answer (``train()`` after a job checked the
        resume before writing anything), it is not verified twice.
        """
        cached = self._resolved_resume
        if cached is not None and (value == cached[0] or (value is not None and value == cached[1])):
            return cached[1]
        path = self._resolve_resume(value)
        self._resolved_resume = (value, path)
        return path

    def _resolve_resume(self, value: str | bool | None) -> str | None:
        value = selection.requested_checkpoint(value)
        if value is None:
            return None
        if value is True or value == selection.AUTO:
            output_dir = self.args.output_dir
            chosen, skipped = selection.newest_complete(output_dir, marker.TRAINER, part=self._verify_part())
            for line in skipped:
                logger.warning("resume: skipping %s", line)
            if chosen is None:
                if value is True:
                    # transformers' words first: scripts match them
                    raise ConfigError(
                        f"No valid checkpoint found in output directory ({output_dir}): no complete checkpoint-N "
                        "folder to resume from"
                        + (f" ({'; '.join(skipped)})" if skipped else "")
                        + ". Pass resume_from_checkpoint='auto' to start fresh when there is none"
                    )
                logger.warning("resume: no complete checkpoint in %s, starting from scratch", output_dir)
                return None
            logger.warning("resume: from %s, the newest complete checkpoint", chosen)
            path = str(chosen)
        else:
            path = value
            if not selection.verify_requested(path, part=self._verify_part()):
                logger.warning(
                    "resume: %s has no %s marker (not saved by trainer_ext); verified its files", path, marker.COMPLETE
                )
        self._check_compatible(Path(path))
        return path

    def _verify_part(self) -> tuple[int, int]:
        """This rank's share of the checksum reading: its index among the ranks of its node."""
        topology = getattr(getattr(self.accelerator, "state", None), "topology", None)
        return (0, 1) if topology is None else topology.node_share

    def _batch_facts(self) -> dict[str, int]:
        """What fixes the data position of a step: the per-rank micro-batch and the global batch."""
        args = self.args
        micro = args.per_device_train_batch_size
        # the ranks that read different batches (ranks of one tensor-parallel group read the same)
        readers = getattr(self.accelerator, "num_data_parallel_processes", args.world_size)
        return {
            "micro_batch_size": micro,
            "global_batch_size": micro * args.gradient_accumulation_steps * readers,
        }

    def _check_compatible(self, path: Path) -> None:
        """Refuse a checkpoint of another model, or of another world size unless the batches line up."""
        facts = marker.read_marker(path) or {}
        saved = facts.get("world_size")
        writer = facts.get("strategy")  # the registry name of the strategy that saved it
        writer = STRATEGIES.get(writer) if isinstance(writer, str) else None
        if (
            saved is not None
            and saved != self.args.world_size
            and writer is not None
            and not writer.reshards_training_state
        ):
            raise ConfigError(
                f"{path.name} is a {writer.title} checkpoint of {saved} processes and this run has "
                f"{self.args.world_size}: resume {writer.title} with the same number of processes"
            )
        if saved is not None and saved != self.args.world_size:
            now = self._batch_facts()
            if any(facts.get(k) != v for k, v in now.items()):
                raise ConfigError(
                    f"{path.name} was saved by {saved} processes, this run has {self.args.world_size}. A run moves to "
                    "another number of processes only with the same per-device batch and the same global batch "
                    f"(per_device_train_batch_size x gradient_accumulation_steps x data-parallel processes): saved "
                    f"{facts.get('micro_batch_size', '?')} / {facts.get('global_batch_size', '?')}, now "
                    f"{now['micro_batch_size']} / {now['global_batch_size']}. Adjust --gradient_accumulation_steps, "
                    f"or start a new run from its weights (--model_name_or_path {path})"
                )
            logger.warning(
                "resume: %s was saved by %d processes, this run has %d: same batches, so the data position carries "
                "over; the per-rank random streams (dropout) start afresh",
                path.name,
                saved,
                self.args.world_size,
            )
        if self.model is None:
            return
        expected_model = self.accelerator.unwrap_model(self.model)
        owner = checkpoint_owner(path)
        if owner is not None:  # a backend's own format: the backend knows what it holds
            owner.check_own_checkpoint(expected_model, path)
            return
        if sharded_checkpoint.has_sharded_model(path):
            sharded_checkpoint.check_model_matches(expected_model, path)
            return
        weights = path / "model.safetensors"
        if not weights.is_file():
            return
        header = check_safetensors(weights)
        saved = {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
        # shapes of parameters only: a model's own load_state_dict may legitimately resize its buffers
        expected = {k: saved.get(k, list(v.shape)) for k, v in expected_model.state_dict().items()}
        expected |= {k: list(v.shape) for k, v in expected_model.named_parameters(remove_duplicate=False)}
        sharded_checkpoint.check_shapes(path.name, saved, expected, must_have=())

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Write ``checkpoint-N`` on every rank, commit it with the marker, then rotate (one process): the commit
        protocol of :func:`trainer_ext.checkpointing.commit.commit`, transformers' save being the write.

        ``save_total_limit`` stays set otherwise, so transformers' end of training keeps only the best checkpoint
        when the limit is 1 (as stock does), and callbacks read the user's value.
        """
        folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
        limit = self.args.save_total_limit

        def save(_: Path) -> None:
            self.args.save_total_limit = None  # transformers' rotation runs before other ranks finish: ours after
            try:
                super(CheckpointingMixin, self)._save_checkpoint(model, trial)
            finally:
                # At the end of training transformers deletes every checkpoint but the best when the limit is 1; a
                # preempted run has not ended, so its last checkpoint must stay: train() restores the limit after.
                preempted = self._preemption is not None and self._preemption.preempted_at is not None
                if not (preempted and getattr(self, "is_in_train", False)):
                    self.args.save_total_limit = limit

        def rotated(final: Path) -> None:
            for path in rotate(final.parent, limit, best=self.state.best_model_checkpoint):
                logger.info("deleted %s (save_total_limit=%s)", path.name, limit)

        commit(
            folder,
            save,
            main=self.args.should_save,
            marker={
                "world_size": self.args.world_size,
                "step": self.state.global_step,
                "strategy": self.accelerator.strategy.name,
                "kind": marker.TRAINER,
                **self._batch_facts(),
            },
            check=lambda: self._check_folder(folder),  # every rank raises when it is refused: none waits alone
            rotate=rotated,
            barrier=lambda: _barrier(self),
            on_error=lambda error, _: self._raise_if_disk_full(error, folder),
            failed=lambda _, lines: ConfigError(lines),
        )

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """transformers' ``save_metrics``, refusing a link where it writes (the link rule)."""
        if self.is_world_process_zero():
            refuse_saved_links(self.args.output_dir)
        super().save_metrics(split, metrics, combined)

    def save_state(self) -> None:
        """transformers' ``save_state``, refusing a link where it writes (the link rule)."""
        if self.is_world_process_zero():
            refuse_saved_links(self.args.output_dir)
        super().save_state()

    def _check_folder(self, folder: Path) -> None:
        """The link rule for ``checkpoint-N`` (saving processes): refuse a link at or inside it, or a file there.
        What an earlier save left in it (one that died, or of another run) is cleared by the commit's tag."""
        if not self.args.should_save:
            return
        refuse_links_under(folder, f"checkpoint {folder.name}, about to be saved")
        if os.path.lexists(folder) and not folder.is_dir():
            raise ConfigError(
                f"{str(folder)!r} is not a folder: the checkpoint of step {self.state.global_step} goes there. "
                "Move it away and run again"
            )

    def _raise_if_disk_full(self, error: BaseException, folder: Path) -> None:
        """A save that ran out of space: remove what it wrote (it has no marker) and say so in one clear error,
        naming the checkpoint that is still intact, instead of torch's ``basic_ios::clear: iostream error``."""
        if not disk_space.is_disk_full(error):
            return
        if self.args.should_save:
            marker.remove_marker(folder)
            shutil.rmtree(folder, ignore_errors=True)
        intact = [p for p in sorted_checkpoints(folder.parent) if marker.is_complete(p)]
        needed = disk_space.checkpoint_bytes(self.accelerator.unwrap_model(self.model)) if self.model else None
        kept = intact[-1].name if intact else None
        raise disk_space.save_failed(folder, error, needed, kept) from None

    def get_train_dataloader(self) -> Any:
        """The Trainer's loader; with ``save_on_preemption`` its workers leave SIGTERM/SIGUSR1 to the trainer."""
        loader = super().get_train_dataloader()
        if (
            self._preemption is not None
            and getattr(loader, "num_workers", 0) > 0
            and not isinstance(loader.worker_init_fn, WorkerInit)
        ):
            wrapped = WorkerInit(loader.worker_init_fn)
            loader.worker_init_fn = wrapped
            if isinstance(getattr(loader, "_loader_kwargs", None), dict):
                loader._loader_kwargs["worker_init_fn"] = wrapped
        return loader
