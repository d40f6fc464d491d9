"""The ``Accelerator``'s models on disk: unwrap, state dicts, ``save``/``save_model``, ``save_state``/``load_state``.

``save_state`` writes through :mod:`trainer_ext.checkpointing.loop_state` (every rank's share, a commit marker
last); accelerate's project settings choose the folder (``automatic_checkpoint_naming``, ``total_limit``) and its
pre-hooks see the models before anything is written or read. ``load_state`` also reads a folder written by
accelerate's own ``save_state`` (:mod:`trainer_ext.checkpointing.accelerate_format`), so a job started under
accelerate continues after its import is switched. Both log accelerate's INFO lines, in its words.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from trainer_ext.accelerator.loop_helpers import get_logger
from trainer_ext.checkpointing import accelerate_format, links, selection
from trainer_ext.checkpointing import loop_state as checkpoint
from trainer_ext.checkpointing.marker import COMPLETE
from trainer_ext.distributed.precision import Precision
from trainer_ext.errors import ConfigError

logger = logging.getLogger(__name__)
progress = get_logger(__name__)  # accelerate's progress lines: INFO, "[RANK 0] ", the main process only


def writes_saves(host: Any) -> bool:
    """Whether this process writes ``save``/``save_model`` files: the main process, or with
    ``ProjectConfiguration(save_on_each_node=True)`` each node's local main process (accelerate's rule)."""
    if host.project_configuration.save_on_each_node:
        return bool(host.is_local_main_process)
    return bool(host.is_main_process)


def unwrap_module(
    engine: Any, model: torch.nn.Module, keep_fp32_wrapper: bool, keep_torch_compile: bool
) -> torch.nn.Module:
    """The user's module; ``keep_fp32_wrapper=False`` also removes the autocast patch of ``forward``."""
    inner = engine.unwrap_model(model, keep_torch_compile=keep_torch_compile)
    if not keep_fp32_wrapper:
        Precision.restore_forward(engine.unwrap_model(inner, keep_torch_compile=False))
    return inner


class CheckpointHost(Protocol):
    """What :class:`StateCheckpoints` asks of its Accelerator: accelerate's public names, called where accelerate's
    ``save_state``/``load_state``/``save_model`` call them, so that a subclass's overrides take part."""

    engine: Any
    project_configuration: Any

    @property
    def is_main_process(self) -> bool: ...

    @property
    def is_local_main_process(self) -> bool: ...

    def wait_for_everyone(self) -> None: ...

    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module: ...


class StateCheckpoints:
    """An Accelerator's models and training state on disk: what ``save_state`` includes (prepared objects, the
    schedulers and objects registered with it), its pre-hooks, ``save``/``save_model``, and the project's folders."""

    def __init__(self, host: CheckpointHost) -> None:
        self.host = host
        self.engine = host.engine
        self.schedulers: list[Any] = []  # the prepared LR schedulers (accelerate's ``_schedulers``)
        self.custom: list[Any] = []  # register_for_checkpointing's objects
        self.save_hooks: OrderedDict[int, Any] = OrderedDict()  # a handle holds it by weak reference
        self.load_hooks: OrderedDict[int, Any] = OrderedDict()
        self._warned_pickled_state = False

    @property
    def config(self) -> Any:
        """The Accelerator's ``ProjectConfiguration`` (read each time: a script may replace it)."""
        return self.host.project_configuration

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Save ``obj`` from the main process only (each node's, under ``save_on_each_node``): ``torch.save``, or
        safetensors for a dict of tensors."""
        if not writes_saves(self.host):
            return
        if not safe_serialization:
            torch.save(obj, f)
            return
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise ConfigError(
                f"save(safe_serialization=True) writes a dict of tensors, got {type(obj).__name__}; pass a state "
                "dict, or safe_serialization=False for other objects (torch.save)"
            )
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous().cpu() for k, v in obj.items()}, str(f), metadata={"format": "pt"})

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: str | int = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the unwrapped model as safetensors (split above ``max_shard_size``) from the main process (each
        node's with ``save_on_each_node``).

        All ranks call it; a sharded model is gathered by its strategy (FSDP: one tensor at a time, never whole on
        one rank; DeepSpeed ZeRO-3: gathered and checked complete).
        """
        if not safe_serialization:  # transformers 5 dropped pickled weights from save_pretrained as well
            raise ConfigError(
                "save_model(safe_serialization=False) is not supported: models are written as safetensors only "
                "(from_pretrained and safetensors.torch.load_file read them); drop the argument, or use "
                "accelerator.save(accelerator.get_state_dict(model), path) for a torch.save file"
            )

        unwrapped = self.host.unwrap_model(model, keep_torch_compile=False)
        self.engine.export_model(unwrapped, save_directory, max_shard_size, writer=writes_saves(self.host))
        self.host.wait_for_everyone()

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Extra objects with ``state_dict``/``load_state_dict`` to include in ``save_state``."""
        for obj in objects:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(f"{type(obj).__name__} has no state_dict/load_state_dict; it cannot be checkpointed")
            self.custom.append(obj)

    def _checkpoint_objects(self) -> dict[str, Any]:
        return {
            "models": [self.host.unwrap_model(m, keep_torch_compile=False) for m in self.engine.prepared_models],
            "optimizers": [o.optimizer for o in self.engine.prepared_optimizers],
            "schedulers": [s.scheduler for s in self.schedulers],
            "dataloaders": self.engine.prepared_dataloaders,
            "scaler": self.engine.scaler,
            "custom": self.custom,
            "strategy": self.engine.strategy,
        }

    def _checkpoints_root(self, call: str) -> Path:
        if self.config.project_dir is None:
            raise ConfigError(
                f"{call} needs a directory, or project_dir=... (or project_config=ProjectConfiguration(...)) set on "
                "the Accelerator"
            )
        return Path(self.config.project_dir) / "checkpoints"

    def _automatic_folder(self) -> tuple[Path, list[Path]]:
        """``project_dir/checkpoints/checkpoint_<iteration>``, and the oldest folders beyond ``total_limit`` that
        accelerate deletes for it: deleted here only once the new checkpoint is committed (:meth:`_rotate`)."""
        root = self._checkpoints_root("save_state() with automatic_checkpoint_naming")
        config = self.config
        if self.host.is_main_process:
            root.mkdir(parents=True, exist_ok=True)
        self.host.wait_for_everyone()  # every process looks at the folder after the main one made it
        saved = sorted(selection.numbered_states(root), key=lambda pair: pair[0])
        extra = len(saved) + 1 - config.total_limit if config.total_limit is not None else 0
        doomed = [folder for _, folder in saved[: max(extra, 0)]]
        folder = root / f"checkpoint_{config.iteration}"
        if folder.exists() and folder not in doomed:
            raise ConfigError(
                f"Checkpoint directory {folder} ({config.iteration}) already exists. Please manually override "
                "`self.save_iteration` with what iteration to start with."
            )
        self.host.wait_for_everyone()
        return folder, doomed

    def _rotate(self, doomed: list[Path], kept: Path, aside: Path | None) -> None:
        """After a committed save: delete the folders accelerate's rotation deletes (a link: the link itself)."""
        if self.host.is_main_process and doomed:
            logger.warning("Deleting %d checkpoints to make room for new checkpoint.", len(doomed))
            for folder in [*doomed, *([aside] if aside is not None else [])]:
                if folder != kept:  # the new checkpoint took this one's place
                    links.remove_entry(folder)
        self.host.wait_for_everyone()  # no process lists the checkpoints while they are being deleted

    def _set_aside(self, folder: Path) -> Path | None:
        """A doomed ``folder`` about to be reused that is not one of ours (accelerate's): renamed aside, so that a
        failed save can put it back; None when there is nothing to set aside."""
        aside = folder.with_name(f".{folder.name}.rotated")
        if not folder.is_dir() or folder.is_symlink() or (folder / COMPLETE).is_file():
            return None  # absent, a link (refused by the save) or ours (replaced by the save's own swap)
        links.refuse_link(aside, "the checkpoint set aside")
        if self.host.is_main_process:
            os.replace(folder, aside)
        self.host.wait_for_everyone()
        return aside

    def _hidden_from_hooks(self, model: torch.nn.Module) -> bool:
        return self.engine.strategy.writes_training_state(model)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, weights, output_dir)`` runs in ``save_state`` before anything is written; removing an entry
        of ``weights`` (the models' state dicts) leaves that model to the hook (it may write it into
        ``output_dir`` itself). Returns a handle whose ``remove()`` unregisters it."""
        handle = RemovableHandle(self.save_hooks)
        self.save_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, input_dir)`` runs in ``load_state`` before anything is read; removing a model from
        ``models`` leaves its loading to the hook."""
        handle = RemovableHandle(self.load_hooks)
        self.load_hooks[handle.id] = hook
        return handle

    def save_state(self, output_dir: str | os.PathLike | None, step: int, safe_serialization: bool = True) -> str:
        """All ranks: models, optimizers, schedulers, scaler, RNG of every rank, dataloader positions, registered
        objects; committed by a ``COMPLETE`` marker written last.

        With ``ProjectConfiguration(automatic_checkpoint_naming=True)``: ``project_dir/checkpoints/checkpoint_<i>``,
        keeping ``total_limit``. Without a folder otherwise: ``project_dir/checkpoints/checkpoint``.
        """
        if not safe_serialization and not self._warned_pickled_state:
            self._warned_pickled_state = True  # accelerate's scripts pass it; the folder is ours either way
            logger.warning(
                "save_state(safe_serialization=False): weights are written as safetensors all the same (load_state "
                "reads them; pickled weights are not written)"
            )
        doomed: list[Path] = []
        if self.config.automatic_checkpoint_naming:
            output_dir, doomed = self._automatic_folder()
        elif output_dir is None:
            output_dir = self._checkpoints_root("save_state()") / "checkpoint"
        objects = self._checkpoint_objects()
        hooks = list(self.save_hooks.values())
        progress.info(f"Saving current state to {output_dir}")

        def before_write(folder: Path) -> None:  # hooks see the folder being written (it becomes output_dir)
            if not hooks:
                return
            models = objects["models"]
            # accelerate hands the hooks the state dicts it is about to write: none for models it does not write
            # whole (sharded over ranks, or in the backend's own checkpoint)
            whole = [model for model in models if not self._hidden_from_hooks(model)]
            originals = [model.state_dict() for model in whole]
            weights = list(originals)
            for hook in hooks:
                hook(models, weights, str(folder))
            dropped = [m for m, w in zip(whole, originals, strict=True) if not any(w is kept for kept in weights)]
            models[:] = [m for m in models if not any(m is d for d in dropped)]

        aside = self._set_aside(Path(output_dir)) if Path(output_dir) in doomed else None
        try:
            path = checkpoint.save_state(
                output_dir,
                self.engine.state,
                **objects,
                extra={"step": step, "processes": self.engine.num_data_parallel_processes},
                before_write=before_write,
            )
        except BaseException:
            if aside is not None and self.host.is_main_process and not Path(output_dir).exists():
                os.replace(aside, output_dir)  # the save failed: the folder it was to replace is back
            raise
        # rotation only now, with the new checkpoint committed: a failed save leaves the previous ones loadable
        self._rotate(doomed, path, aside)
        if self.host.is_main_process:
            dataloaders, scaler = len(objects["dataloaders"]), self.engine.scaler is not None
            for line in accelerate_format.saved_lines(path, dataloaders, objects["custom"], scaler):
                progress.info(line)
        self.config.iteration += 1
        return str(path)

    def load_state(self, input_dir: str | os.PathLike | None) -> int | None:
        """All ranks, after ``prepare``: restore what ``save_state`` wrote, in the same preparation order, including
        each loader's position (so the next pass continues where the saved one stopped; calling
        ``skip_first_batches`` for the resumed epoch as well, as accelerate's examples do, skips once, not twice).

        A folder written by accelerate's ``save_state`` is restored as accelerate restores it (the loaders keep
        their position: ``skip_first_batches`` skips what was seen). Without ``input_dir``: the newest checkpoint
        under ``project_dir/checkpoints``. Loading ``checkpoints/checkpoint_<n>`` under automatic checkpoint naming
        makes the next automatic save ``checkpoint_<n+1>`` (unless ``iteration`` is already past it). Returns the
        accumulation step count to continue from (None: keep the current one).
        """
        if input_dir is not None:
            input_dir = os.path.expanduser(input_dir)
        else:
            input_dir = selection.newest_state(self._checkpoints_root("load_state()"))
        objects = self._checkpoint_objects()
        if self.load_hooks:  # hooks see the models loaded from whole files, as in accelerate
            visible = [m for m in objects["models"] if not self._hidden_from_hooks(m)]
            shown = list(visible)
            for hook in self.load_hooks.values():
                hook(visible, str(input_dir))
            taken = [m for m in shown if not any(m is kept for kept in visible)]
            objects["models"][:] = [m for m in objects["models"] if not any(m is t for t in taken)]
        if accelerate_format.is_accelerate_checkpoint(input_dir):
            found = accelerate_format.load_accelerate_state(input_dir, self.engine.state, **objects)
            step = found["step"]  # accelerate's step counter, as its load_state sets it (when it saved one)
            scaler, random_states = found["scaler"], found["random"]
        else:
            extra = checkpoint.load_state(input_dir, self.engine.state, **objects)
            # the accumulation count is in micro-batches of this process: on another number of processes, the same
            # share of the epoch (the loaders translate their positions the same way)
            here = self.engine.num_data_parallel_processes  # the ranks that read different batches
            processes = int(extra.get("processes", here))
            step = int(extra.get("step", 0)) * processes // here
            scaler, random_states = self.engine.scaler is not None, True
        if self.host.is_main_process:  # accelerate's lines, said once the folder is loaded (after the loader's own)
            progress.info(f"Loading states from {input_dir}")
            for line in accelerate_format.loaded_lines(input_dir, objects["custom"], scaler, random_states):
                progress.info(line)
        self._continue_numbering(Path(input_dir))
        return step

    def _continue_numbering(self, folder: Path) -> None:
        """After loading ``project_dir/checkpoints/checkpoint_<n>`` under automatic naming, the next save is
        ``checkpoint_<n+1>``: accelerate leaves ``iteration`` as it was, so its next save collides or reuses a lower
        number (a ``total_limit`` rotation would then delete the newest checkpoints first)."""
        config = self.config
        match = selection.NUMBERED_STATE.fullmatch(folder.name)
        if not (config.automatic_checkpoint_naming and self.config.project_dir is not None and match):
            return
        if folder.parent.resolve() == self._checkpoints_root("load_state()").resolve():
            config.iteration = max(config.iteration, int(match.group(1)) + 1)
