"""UnwrapAndSaveCallback: checkpoints that are checked, and a final model in ``output_dir`` that reloads.

Where it writes, so that it never fights the Trainer's own saving:

- at each save the Trainer has already written ``checkpoint-N`` (through ``save_model``); this callback does not
  write it again, it checks it: the safetensors headers must hold the unwrapped model's parameter names and shapes;
- at the end of training it writes the final model (unwrapped: DDP, ``torch.compile``; a PEFT model as its adapters,
  where PEFT's ``save_pretrained`` puts them: ``default`` at the top, any other in a sub-folder of its name), its config and the tokenizer (``processing_class``) as safetensors to
  ``output_dir`` — where ``trainer.save_model()`` writes by default, so a later call by the user rewrites the same
  files — then checks them the same way.

Only the saving processes (``args.should_save``: the main process) write and check; the others wait for their verdict,
and a mismatch raises the same error on every rank.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from trainer_ext.checkpointing import sharded as sharded_checkpoint
from trainer_ext.checkpointing.links import move_into, remove_entry
from trainer_ext.checkpointing.saving import is_peft_model, save_model, saved_weight_names, tied_groups
from trainer_ext.distributed.strategies import checkpoint_owner
from trainer_ext.errors import ConfigError

MODEL_FILE, ADAPTER_FILE = "model.safetensors", "adapter_model.safetensors"
PROCESSING_FILES = ("tokenizer_config.json", "processor_config.json", "preprocessor_config.json")
# the weights an earlier save into the same folder may have left: replaced as a whole (save_pretrained's rule)
_WEIGHTS = re.compile(r"(model|adapter_model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")


class SavedModelMismatchError(RuntimeError):
    """The files saved for a model do not hold its parameter names and shapes."""


def _shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(getattr(v, "ds_shape", v.shape)) for k, v in state.items()}  # ZeRO-3: the full shape


def _adapter_tensors(model: torch.nn.Module) -> dict[str, dict[str, tuple[int, ...]]] | None:
    """Names and shapes of each adapter a PEFT model saves, by the sub-folder it goes to; None without adapters.

    ``PeftModel.save_pretrained`` writes every adapter, the one named ``default`` at the top and each other one in a
    sub-folder of its name; a transformers model with ``add_adapter`` writes its active adapter at the top.
    """
    if is_peft_model(model):
        from peft import get_peft_model_state_dict  # peft is installed: the model is one of its classes

        entries = model.state_dict(keep_vars=True)  # keep_vars: a ZeRO-3 partition keeps its full shape
        return {
            "" if name == "default" else name: _shapes(
                get_peft_model_state_dict(model, state_dict=entries, adapter_name=name)
            )
            for name in model.peft_config
        }
    if getattr(model, "_hf_peft_config_loaded", False):  # saved in PEFT's format: names under its wrapper's prefix
        return {"": {f"base_model.model.{k}": v for k, v in _shapes(model.get_adapter_state_dict()).items()}}
    return None


def _expected_tensors(model: torch.nn.Module) -> tuple[dict[str, tuple[int, ...]], dict[str, set[str]]]:
    """Names and shapes ``save_pretrained`` writes for a whole model, and the names that share storage (tied)."""
    whole = getattr(model, "_trainer_ext_full_shapes", None)
    if whole is not None:  # one pipeline stage's part of the model: the consolidated file holds all of it
        return {k: tuple(v) for k, v in whole.items()}, {}
    state = model.state_dict(keep_vars=True)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    tied = {name: set(group) - {name} for group in tied_groups(state) for name in group}
    shapes = _shapes(state)
    if getattr(model, "config", None) is not None and hasattr(model, "save_pretrained"):
        meta = {k: torch.empty(shapes[k], dtype=v.dtype, device="meta") for k, v in state.items()}
        converted = saved_weight_names(model, meta)  # transformers renames some weights on save
        if converted is not None and set(converted) != set(meta):
            return _shapes(converted), tied
    return shapes, tied


def saved_tensors(folder: str | os.PathLike, weights_file: str = MODEL_FILE) -> dict[str, tuple[int, ...]]:
    """Names and shapes in a folder's safetensors weights (one file, or the shards of its ``.index.json``)."""
    folder = Path(folder)
    index = folder / f"{weights_file}.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / weights_file).is_file():
        files = [weights_file]
    else:
        raise SavedModelMismatchError(f"{folder} holds no {weights_file} (nor {index.name})")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _compare(
    folder: Path, expected: dict[str, tuple[int, ...]], tied: dict[str, set[str]], weights_file: str
) -> list[str]:
    """What is missing, unexpected or of the wrong shape in one folder's weights (a tied name may be absent when
    one of its group is saved: ``save_pretrained`` keeps one copy)."""
    try:
        saved = saved_tensors(folder, weights_file)
    except SavedModelMismatchError as e:
        return [str(e)]
    must_have = [k for k in expected if k in saved or not tied.get(k, set()) & saved.keys()]
    return sharded_checkpoint.shape_problems(saved, expected, must_have)


def verify_saved_model(model: torch.nn.Module, folder: str | os.PathLike, processing_class: Any = None) -> None:
    """Raise :class:`SavedModelMismatchError` unless ``folder`` reloads into ``model``'s parameter names and shapes.

    A tied weight (sharing storage with another) may be missing from the files when one of its group is there:
    ``save_pretrained`` keeps one copy. A PEFT model is checked as its adapters, each in the folder PEFT gives it.
    """
    folder = Path(folder)
    adapters = _adapter_tensors(model)
    problems: list[str] = []
    if adapters is None:
        problems += _compare(folder, *_expected_tensors(model), MODEL_FILE)
        if getattr(model, "config", None) is not None and not (folder / "config.json").is_file():
            problems.append("no config.json")
    for sub, expected in (adapters or {}).items():
        where, label = folder / sub, f"adapter {sub}: " if sub else ""
        problems += [label + p for p in _compare(where, expected, {}, ADAPTER_FILE)]
        if not (where / "adapter_config.json").is_file():
            problems.append(f"{label}no adapter_config.json")
    if processing_class is not None and not any((folder / f).is_file() for f in PROCESSING_FILES):
        problems.append(f"no tokenizer/processor files (looked for {', '.join(PROCESSING_FILES)})")
    if problems:
        raise SavedModelMismatchError(
            f"the model saved in {folder} does not reload as {type(model).__name__}: " + "; ".join(problems)
        )


def save_unwrapped(model: torch.nn.Module, folder: str | os.PathLike, processing_class: Any = None) -> None:
    """Write an already unwrapped model (+ config) and its tokenizer/processor to ``folder`` as safetensors.

    Written into a fresh temporary folder inside ``folder``, then renamed into place: a link in ``folder`` where a
    file goes is replaced, never written through (the link rule)."""
    os.makedirs(folder, exist_ok=True)
    fresh = Path(tempfile.mkdtemp(prefix=".trainer_ext_saving_model.", dir=folder))
    try:
        if hasattr(model, "save_pretrained"):  # PreTrainedModel, and PeftModel (writes the adapter only)
            model.save_pretrained(fresh)
        else:  # a plain module: safetensors (sharded above 10GB) the one way every saver of ours writes
            save_model(model, fresh)
        if processing_class is not None:
            processing_class.save_pretrained(fresh)
        for sub in [Path(), *(p.relative_to(fresh) for p in fresh.rglob("*") if p.is_dir())]:
            written, there = {p.name for p in (fresh / sub).iterdir()}, Path(folder) / sub
            if sub.parts and any(Path(folder, *sub.parts[: i + 1]).is_symlink() for i in range(len(sub.parts))):
                continue  # a link where a sub-folder goes: replaced whole by move_into, nothing looked at in it
            for old in there.iterdir() if there.is_dir() else ():
                if _WEIGHTS.fullmatch(old.name) and old.name not in written:
                    remove_entry(old)  # an earlier save's other weights (a link: itself) would be read back
        move_into(fresh, folder)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)


def _agree(error: str | None) -> None:
    """Raise on every rank when any rank has an error (the non-saving ranks wait here for the saving ones)."""
    errors = [error]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    found = [f"rank {rank}: {e}" for rank, e in enumerate(errors) if e]
    if found:
        raise SavedModelMismatchError("; ".join(found))


class UnwrapAndSaveCallback(TrainerCallback):
    """Check each checkpoint the Trainer writes; write and check the final model at the end of training.

    With ``trainer`` the model is ``trainer.accelerator.unwrap_model(trainer.model_wrapped)``; without it, the model the
    Trainer hands to callbacks (its ``model``, already outside DDP; a ``torch.compile`` wrapper is removed).
    ``final_dir`` defaults to ``output_dir``; ``save_final=False`` only checks checkpoints.
    """

    def __init__(
        self, trainer: Any = None, final_dir: str | os.PathLike | None = None, save_final: bool = True
    ) -> None:
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        self.final_dir = final_dir
        self.save_final = save_final
        self.verified: list[str] = []  # folders checked, in order

    def _model(self, model: Any, processing_class: Any) -> tuple[torch.nn.Module, Any]:
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is not None:
            unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped, keep_torch_compile=False)
            return unwrapped, trainer.processing_class
        return getattr(model, "_orig_mod", model), processing_class

    def _check(self, args: Any, folder: str, write: bool, model: Any, processing_class: Any) -> None:
        error = None
        trainer = self._trainer() if self._trainer is not None else None
        sharded = trainer is not None and getattr(trainer, "model_is_sharded", lambda: False)()
        if write and sharded:  # every rank takes part in gathering the shards
            try:
                trainer.save_model(folder)
            except ConfigError:
                raise  # a link where the model goes: refused on every rank alike (the link rule)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        if args.should_save and error is None:
            try:
                model, processing_class = self._model(model, processing_class)
                if write and not sharded:
                    save_unwrapped(model, folder, processing_class)
                if not write and sharded_checkpoint.has_sharded_model(folder):
                    sharded_checkpoint.check_model_matches(model, folder)
                elif not write and checkpoint_owner(folder) is not None:
                    pass  # a backend's own format (DeepSpeed's): the backend checks it when it loads it
                else:
                    verify_saved_model(model, folder, processing_class)
            except Exception as e:  # reported on every rank by _agree, so none is left waiting
                error = f"{type(e).__name__}: {e}"
        _agree(error)
        self.verified.append(folder)

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.is_hyper_param_search:  # checkpoints then go to a per-trial folder
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self._check(args, folder, False, model, processing_class)

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        trainer = self._trainer() if self._trainer is not None else None
        preempted = getattr(getattr(trainer, "_preemption", None), "preempted_at", None) is not None
        # a preempted run is not finished (its checkpoint is what counts), and a search trial is not the model
        if self.save_final and not preempted and not getattr(state, "is_hyper_param_search", False):
            self._check(args, str(self.final_dir or args.output_dir), True, model, processing_class)
