"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state sharded over ranks.

``fully_shard`` turns the model's parameters into DTensors in place (same module object, new Parameter objects),
so an optimizer built before wrapping is re-pointed at the sharded parameters (:meth:`adopt_optimizer`).
Gradient accumulation uses FSDP2's own switch (``set_requires_gradient_sync``), and clipping computes the
norm over the shards of every rank.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from trainer_ext.checkpointing import loop_state
from trainer_ext.checkpointing import sharded as sharded_checkpoint
from trainer_ext.distributed.mesh.compose import fsdp_mesh
from trainer_ext.distributed.mesh.config import ParallelismConfig
from trainer_ext.distributed.mesh.grad_norm import clip_grad_norm
from trainer_ext.distributed.mesh.tensor_parallel import apply_tensor_parallel, is_tensor_parallel
from trainer_ext.distributed.state import DistributedType, DistState
from trainer_ext.distributed.strategies.base import Strategy
from trainer_ext.distributed.strategies.fsdp.arguments import plugin_args_from_training_args
from trainer_ext.distributed.strategies.fsdp.config import FSDPSettings
from trainer_ext.errors import ConfigError

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MODE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def is_sharded(model: torch.nn.Module) -> bool:
    """True when ``model`` (or a submodule) is an FSDP2 module."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


def layer_classes(model: torch.nn.Module) -> list[str]:
    """Class names of the model's submodules that hold parameters (what a wrap class may name)."""
    names = {type(m).__name__ for m in model.modules() if m is not model and any(True for _ in m.parameters())}
    return sorted(names)


def checkpoint_forward(module: torch.nn.Module) -> None:
    """Recompute ``module``'s activations in backward (non-reentrant checkpointing of its own forward).

    Patched on the instance, inside ``__call__``: FSDP's hooks on the module run once, not again at recompute.
    """
    if getattr(module, "_trainer_ext_checkpointed", False):
        return
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    module._trainer_ext_checkpointed = True


class FSDPStrategy(Strategy):
    """Shards each wrap unit (decoder layers by default), then the root, with ``fully_shard``; with frozen and
    trainable parameters both (LoRA), trainable leaf modules first, so no unit mixes the two."""

    name = "fsdp"
    title = "FSDP"
    # one process trains on a mesh of one rank (the code path and checkpoints of N GPUs, CPU offload on one GPU):
    # in the launcher's group of one, or in one the process starts itself when no launcher started it
    needs_process_group = True
    option_names = ("settings", "mixed_precision")

    def __init__(
        self, state: DistState, settings: FSDPSettings | dict | None = None, mixed_precision: str = "no", **_: Any
    ) -> None:
        super().__init__(state)
        if not isinstance(settings, FSDPSettings):
            settings = FSDPSettings.from_dict(settings or {})
        self.settings = settings
        self.mixed_precision = mixed_precision
        # id(parameter before wrapping) -> (weak reference to it, its DTensor successor): the weak reference lets
        # the unsharded parameter be freed, and tells its entry from a later object that reuses the same id
        self._sharded: dict[int, tuple[weakref.ref, torch.nn.Parameter]] = {}
        self._mesh = None

    @classmethod
    def read_training_arguments(cls, args: Any) -> dict[str, Any]:
        """``--fsdp``/``--fsdp_config``: the settings checked and normalised on ``args``, as ``fsdp_plugin_args``."""
        return plugin_args_from_training_args(args)

    @property
    def distributed_type(self) -> DistributedType:
        return DistributedType.FSDP

    # -- wrapping -------------------------------------------------------------------------------
    @classmethod
    def check_parallelism(cls, config: ParallelismConfig) -> None:
        """Any layout of the mesh but replication alone, which has nothing for FSDP to shard."""
        if config.dp_replicate_enabled and not config.splits_model:
            raise ConfigError(
                f"FSDP with parallelism_config dp_replicate_size={config.dp_replicate_size} alone has no dimension to "
                f"shard over: set dp_shard_size (HSDP: dp_replicate_size x dp_shard_size processes), or drop --fsdp "
                "for plain data parallelism"
            )

    def mesh(self) -> Any:
        """The 1-D mesh of all ranks, or the 2-D (replicate, shard) mesh of hybrid sharding; under a
        ``parallelism_config``, its shard dimensions (None when it shards by tensor parallelism alone)."""
        if self.parallelism is not None:
            return None if self.parallel is None else fsdp_mesh(self.parallel, self.parallelism)
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            world, device = self.state.num_processes, self.state.device.type
            if not self.settings.hybrid_shard:
                self._mesh = init_device_mesh(device, (world,))
            else:
                replicate = self.settings.replicate_size or self.state.topology.num_nodes
                if world % replicate:
                    raise ConfigError(
                        f"fsdp_config: replicate_size {replicate} does not divide the {world} processes; choose a "
                        "divisor (hybrid sharding = replicate_size groups of world/replicate_size shards)"
                    )
                self._mesh = init_device_mesh(
                    device, (replicate, world // replicate), mesh_dim_names=("replicate", "shard")
                )
        return self._mesh

    def mp_policy(self) -> MixedPrecisionPolicy:
        """Parameters in the compute dtype of ``--bf16``/``--fp16`` during forward/backward, gradients reduced in fp32."""
        param = _DTYPES.get(self.settings.param_dtype or "") or _MODE_DTYPES.get(self.mixed_precision)
        reduce = _DTYPES.get(self.settings.reduce_dtype or "") or (torch.float32 if param is not None else None)
        return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)

    def wrap_targets(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The submodules sharded on their own (children before parents), by layer class or by size."""
        policy = self.settings.auto_wrap_policy
        if policy == "none":
            return []
        if policy == "size":
            return _size_targets(model, self.settings.min_num_params)
        names = self.settings.transformer_layer_cls_to_wrap
        if names is None:
            names = tuple(getattr(model, "_no_split_modules", None) or ())
            if not names:
                logger.warning(
                    "FSDP: %s names no _no_split_modules and fsdp_config sets no transformer_layer_cls_to_wrap: "
                    "the whole model is one unit (all parameters gathered at once)",
                    type(model).__name__,
                )
                return []
        present = layer_classes(model)
        unknown = [n for n in names if n not in present]
        if unknown:
            raise ConfigError(
                f"fsdp_config: transformer_layer_cls_to_wrap names {', '.join(unknown)}, which "
                f"{type(model).__name__} does not contain; its layer classes are: {', '.join(present)}"
            )
        wanted = set(names)
        return [m for m in reversed(list(model.modules())) if m is not model and type(m).__name__ in wanted]

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if isinstance(model, FSDPModule) or not any(p.requires_grad for p in model.parameters()):
            return model
        before = dict(model.named_parameters())
        if self.parallel is not None and self.parallelism.tp_enabled:
            plan = getattr(self.parallelism.tp_handler, "tp_plan", None)
            apply_tensor_parallel(model, self.parallel["tp"], plan)
        targets = self.wrap_targets(model)
        if self.settings.activation_checkpointing:
            if not targets:
                raise ConfigError(
                    "fsdp_config: activation_checkpointing needs wrap units (layers) to recompute; set "
                    "transformer_layer_cls_to_wrap or auto_wrap_policy SIZE_BASED_WRAP"
                )
            for module in targets:
                checkpoint_forward(module)
        mesh = self.mesh()
        if mesh is None:  # tensor parallelism alone: nothing left to shard
            self._remember(before, model)
            return model
        kwargs: dict[str, Any] = {
            "mesh": mesh,
            "reshard_after_forward": self.settings.reshard_after_forward,
            "mp_policy": self.mp_policy(),
        }
        if self.settings.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        for module in trainable_islands(model, targets) + targets:
            fully_shard(module, **kwargs)
        # the root's parameters (embeddings, head) are the first that backward needs: torch's own default keeps
        # them gathered from forward to backward, which saves one all-gather per step
        if kwargs["reshard_after_forward"] is True and targets:
            kwargs["reshard_after_forward"] = None
        fully_shard(model, **kwargs)
        self._remember(before, model)
        return model

    def _remember(self, before: dict[str, torch.nn.Parameter], model: torch.nn.Module) -> None:
        """Map each parameter ``wrap`` replaced to its DTensor successor (for :meth:`adopt_optimizer`)."""
        after = dict(model.named_parameters())
        self._sharded = {key: entry for key, entry in self._sharded.items() if entry[0]() is not None}
        self._sharded.update(
            {
                id(p): (weakref.ref(p), after[name])
                for name, p in before.items()
                if name in after and after[name] is not p
            }
        )

    def _successor(self, parameter: torch.nn.Parameter) -> torch.nn.Parameter | None:
        """The sharded successor of ``parameter`` if ``wrap`` replaced that very object (not one reusing its id)."""
        entry = self._sharded.get(id(parameter))
        return entry[1] if entry is not None and entry[0]() is parameter else None

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point an optimizer built on the unsharded parameters at their sharded successors."""
        if not self._sharded:
            return
        replaced = any(self._successor(p) is not None for g in optimizer.param_groups for p in g["params"])
        if replaced and any(optimizer.state.values()):
            raise ConfigError(
                "FSDP: the optimizer already holds state for unsharded parameters; prepare the model and the "
                "optimizer before the first step (load optimizer state after prepare)"
            )
        for group in optimizer.param_groups:
            successors = [self._successor(p) for p in group["params"]]
            group["params"] = [p if new is None else new for p, new in zip(group["params"], successors, strict=True)]

    def forget(self) -> None:
        self._sharded.clear()

    # -- the step -------------------------------------------------------------------------------
    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        if isinstance(model, FSDPModule):
            return _gradient_sync_off(model)
        return contextlib.nullcontext()

    def clip_grad_norm_(
        self, parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip by the norm over every rank's shards; returns that norm as a plain tensor (the same on all ranks).
        Under tensor parallelism the gradients mix plain tensors and DTensors of several meshes: summed per mesh."""
        params = [p for p in parameters if p.grad is not None]
        if self.parallel is not None and self.parallelism.tp_enabled:
            return clip_grad_norm(params, max_norm, norm_type)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def make_grad_scaler(self, device_type: str, **kwargs: Any) -> torch.amp.GradScaler:
        """fp16 on CUDA: a scaler that agrees across ranks on inf/NaN found in the gradient shards."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device_type, **kwargs)

    # -- state dicts and checkpoints (torch.distributed.checkpoint: every rank writes its shards) --------------
    def shards_model(self, model: Any) -> bool:
        return model is not None and (is_sharded(model) or is_tensor_parallel(self.unwrap(model)))

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return sharded_checkpoint.full_state_dict(model)

    def export_model(
        self, model: torch.nn.Module, directory: str | os.PathLike, *, max_shard_size: str | int, is_main_process: bool
    ) -> None:
        """Gathered one tensor at a time and written by the main process: the model is never whole on one rank.
        A model with adapters (PEFT) writes its adapter only (only its tensors gathered)."""
        unwrapped = self.unwrap(model)
        if not self.shards_model(unwrapped):
            return super().export_model(
                model, directory, max_shard_size=max_shard_size, is_main_process=is_main_process
            )
        if self.export_adapter(unwrapped, directory, is_main_process=is_main_process):
            logger.info("saved the adapter to %s", directory)
            return None
        stats = sharded_checkpoint.export_consolidated(
            unwrapped, directory, max_shard_size=max_shard_size, is_main_process=is_main_process
        )
        logger.info("saved the consolidated model to %s (%d file(s))", directory, stats["files"])

    def gather_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """A DTensor gathered from every rank's shard (a collective); a plain tensor as it is."""
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        return tensor.detach().to("cpu").contiguous()

    def save_checkpoint_model(self, model: Any, directory: str | os.PathLike) -> None:
        sharded_checkpoint.save_model(model, directory)

    def save_checkpoint_optimizer(self, model: Any, optimizer: Any, directory: str | os.PathLike) -> None:
        sharded_checkpoint.save_optimizer(model, optimizer, directory)

    def save_training_state(self, directory: Path, models: list[Any], optimizers: list[Any]) -> bool:
        loop_state.save_sharded(directory, models, optimizers)
        return True

    def load_training_state(self, directory: Path, models: list[Any], optimizers: list[Any]) -> bool:
        loop_state.load_sharded(directory, models, optimizers)
        return True


@contextlib.contextmanager
def _gradient_sync_off(model: FSDPModule) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def trainable_islands(model: torch.nn.Module, targets: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Leaf modules to shard on their own so that no unit mixes trainable and frozen parameters (LoRA).

    A unit (each of ``targets``, then the root) manages the parameters of its subtree outside nested units. Where
    those are partly frozen and partly trainable (PEFT's LoRA: frozen ``base_layer`` beside trainable ``lora_A`` /
    ``lora_B``), each leaf module of it whose parameters are all trainable becomes a unit first, as peft's own FSDP
    wrap policy does; its forward runs as the unit's, so its hooks gather it. A model whose parameters are all
    trainable (or all frozen) gets none, so its units are unchanged. Parameters used outside their module's forward
    (a ``ParameterDict``) or a module whose own parameters mix stay in the enclosing unit.
    """
    units = {id(m) for m in targets} | {id(model)}
    islands: list[torch.nn.Module] = []

    def members(unit: torch.nn.Module) -> list[torch.nn.Module]:
        found, stack = [], list(unit.children())
        while stack:
            module = stack.pop()
            if id(module) in units:
                continue
            found.append(module)
            stack.extend(module.children())
        return found

    for unit in [*targets, model]:
        inside = members(unit)
        flags = {p.requires_grad for m in [unit, *inside] for p in m.parameters(recurse=False)}
        if flags != {True, False}:
            continue
        for module in inside:
            own = list(module.parameters(recurse=False))
            leaf = next(module.children(), None) is None
            containers = (torch.nn.ParameterDict, torch.nn.ParameterList)
            if leaf and own and all(p.requires_grad for p in own) and not isinstance(module, containers):
                islands.append(module)
    return list({id(m): m for m in islands}.values())


def _size_targets(model: torch.nn.Module, min_num_params: int) -> list[torch.nn.Module]:
    """Post-order: a submodule holding at least ``min_num_params`` parameters not yet in a unit becomes one."""
    covered: set[int] = set()
    targets = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is model:
            return
        own = [p for p in module.parameters() if id(p) not in covered]
        if own and sum(p.numel() for p in own) >= max(1, min_num_params):
            targets.append(module)
            covered.update(id(p) for p in own)

    visit(model)
    return targets
