"""``TrainingArguments`` whose devices and distributed state come from :mod:`trainer_ext.distributed`.

Every transformers flag is accepted unchanged. Only device set-up is replaced: the process group is
started by our :class:`~trainer_ext.distributed.DistState` (gloo on CPU, NCCL on CUDA, ``ddp_timeout``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist
import transformers
import transformers.training_args
from transformers.training_args import ParallelMode

from trainer_ext import env_vars
from trainer_ext.distributed.mesh import setup as mesh_setup
from trainer_ext.distributed.rules import check_precision, claim_world
from trainer_ext.distributed.state import DistributedType, DistState, detect_topology
from trainer_ext.distributed.strategies import STRATEGIES
from trainer_ext.distributed.strategies.fsdp.config import fsdp_requested, launched_fsdp_settings
from trainer_ext.errors import ConfigError
from trainer_ext.trainer import compat as _compat
from trainer_ext.trainer.foreign_accelerate import accelerate_state_set_up

_compat.check_transformers_version()
logger = logging.getLogger(__name__)

# transformers' warning when arguments it set up are not DISTRIBUTED although a process group exists
STOCK_GROUP_WARNING = "torch.distributed process group is initialized, but parallel_mode != ParallelMode.DISTRIBUTED"


def process_group_mismatch() -> str | None:
    """Why our engine would not train this process in the existing process group (one line), or None: no group, or
    a group of the launcher's size (RANK/WORLD_SIZE), which our DistState joins."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        launched = detect_topology().world_size
    except ConfigError:
        return None  # DistState names the bad variable when the arguments are set up
    size = dist.get_world_size()
    if size == launched:
        return None
    return (
        f"a torch.distributed process group of {size} processes exists, but the launcher's variables (RANK, "
        f"WORLD_SIZE) say {launched}, so this process trains on its own: start the script with trainer-ext launch "
        f"--num_processes {size} (or torchrun --nproc_per_node {size})"
    )


class _StockGroupWarningFilter(logging.Filter):
    """Drops transformers' process-group warning where our engine trains this process in that group.

    TRL's parser builds its stock config before we re-base it; on a CPU launch without ``--use_cpu`` accelerate
    starts the group yet leaves that config NOT_DISTRIBUTED, so transformers warns, though ours then runs the group
    as one job. Where ours would not (see :func:`process_group_mismatch`), the warning stays and ours adds its own.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(STOCK_GROUP_WARNING)):
            return True
        return process_group_mismatch() is not None


def _filter_stock_group_warning() -> None:
    """Install the filter on transformers' training_args logger, once (stock arguments may be built before ours)."""
    hf_logger = logging.getLogger(transformers.training_args.__name__)
    if not any(type(f).__name__ == _StockGroupWarningFilter.__name__ for f in hf_logger.filters):
        hf_logger.addFilter(_StockGroupWarningFilter())


_filter_stock_group_warning()


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers' TrainingArguments, set up without accelerate (see the class docs upstream).

    Extra flags: ``--fp8`` and the fp16 loss-scaler settings ``--fp16_init_scale``/``--fp16_growth_interval``.
    """

    fp8: bool = field(
        default=False,
        metadata={
            "help": (
                "Whether to train Linear layers in float8 (torchao, dynamic scaling) with bf16 autocast for the "
                "rest. Needs a CUDA GPU of compute capability >= 8.9 and torchao (`pip install 'torchao>=0.10'`)."
            )
        },
    )
    fp16_init_scale: float = field(
        default=2.0**16,
        metadata={
            "help": (
                "Initial loss scale of the fp16 GradScaler. Lower it (e.g. 1024) when the first steps are all "
                "skipped or the loss turns NaN at the start."
            )
        },
    )
    fp16_growth_interval: int = field(
        default=2000,
        metadata={"help": "Number of consecutive steps without inf/NaN gradients before the fp16 loss scale doubles."},
    )
    preemption_grace_seconds: float = field(
        default=30.0,
        metadata={
            "help": (
                "Seconds the scheduler leaves between SIGTERM/SIGUSR1 and the kill. The checkpoint is saved at the "
                "next step boundary; a warning is logged when that came later than this."
            )
        },
    )
    preemption_exit_code: int = field(
        default=75,
        metadata={"help": "Exit code after the checkpoint saved on SIGTERM/SIGUSR1 (75 = EX_TEMPFAIL, retry later)."},
    )
    preemption_check_steps: int | None = field(
        default=None,
        metadata={
            "help": (
                "Agree across ranks on a received preemption signal every N optimizer steps (a small collective). "
                "Default: every step on one process; on several, about every 2 seconds of training (N follows the "
                "slowest rank's step time) and at the last step."
            )
        },
    )
    save_final_model: bool = field(
        default=False,
        metadata={
            "help": (
                "Whether to write the unwrapped final model (with its config and tokenizer) to `output_dir` at the "
                "end of training and check that it reloads, without a call to `save_model`. On for "
                "`trainer_ext.train` and `trainer-ext train`."
            )
        },
    )
    run_summary: bool = field(
        default=False,
        metadata={
            "help": (
                "Whether to print what one optimizer step means (world size, batches, accumulation, steps, "
                "precision, schedule) when training starts. On for `trainer_ext.train` and `trainer-ext train`."
            )
        },
    )
    exact_eval_loss: bool = field(
        default=False,
        metadata={
            "help": (
                "Whether `eval_loss` is the exact mean over the loss's own units (tokens whose label is not -100 "
                "for a token loss, samples for a per-sample loss) summed over every batch and rank, so that it is "
                "the same for any world size and batch size; transformers' mean of per-batch means is then logged "
                "as `eval_batch_mean_loss`. On for `trainer_ext.train` and `trainer-ext train`."
            )
        },
    )
    save_on_preemption: bool = field(
        default=False,
        metadata={
            "help": (
                "Whether SIGTERM/SIGUSR1 saves a checkpoint at the next step boundary on every rank and then exits "
                "with `preemption_exit_code`. On for `trainer_ext.train` and `trainer-ext train`."
            )
        },
    )

    def __post_init__(self) -> None:
        _compat.install()  # transformers' argument code reads accelerate names (DistributedType) from here on
        self._take_launched_deepspeed()
        self._take_launched_fsdp()
        self._take_parallelism_config()
        self._refuse_unsupported()
        self._check_values()
        if (
            (self.bf16 or self.bf16_full_eval)
            and not self.use_cpu
            and not torch.cuda.is_available()
            and not torch.backends.mps.is_available()
        ):
            # transformers refuses bf16 without a bf16 GPU unless use_cpu is set; without CUDA we run on CPU anyway.
            self.use_cpu = True
        deepspeed, self.deepspeed = self.deepspeed, None  # transformers' own DeepSpeed set-up imports accelerate
        try:
            super().__post_init__()
        except ConfigError:
            raise
        except ValueError as error:
            raise ConfigError(str(error)) from error
        finally:
            self.deepspeed = deepspeed
        # transformers converts it only when accelerate is installed; scripts read its attributes either way
        self.accelerator_config = _compat.accelerator_config(self.accelerator_config)
        if self.fp8:
            if self.fp16 or self.bf16:
                raise ConfigError("--fp8 already runs bf16 autocast around its float8 layers; drop --fp16/--bf16")
            self.mixed_precision = "fp8"
        check_precision(self.mixed_precision, self.device, fp16=self.fp16, bf16=self.bf16)
        if self.fsdp_plugin_args is not None or mesh_setup.shards_by_mesh(self.parallelism_config):
            self._claim_world("fsdp")
        # the resolved --deepspeed config, registered with transformers (ZeRO-3 from_pretrained): keep it alive
        self.hf_deepspeed_config = STRATEGIES["deepspeed"].read_training_arguments(self) if self.deepspeed else None

    def _take_launched_deepspeed(self) -> None:
        """``trainer-ext launch --deepspeed FILE script.py``: arguments that name no DeepSpeed config (nor FSDP)
        train with the launch's, as transformers' do under ``accelerate launch --use_deepspeed``."""
        launched = os.environ.get(env_vars.DEEPSPEED_CONFIG)
        if not launched or self.deepspeed:
            return
        if fsdp_requested(self.fsdp):
            raise ConfigError(
                f"trainer-ext launch was given a DeepSpeed config ({env_vars.DEEPSPEED_CONFIG}={launched}) and these "
                "arguments ask for FSDP (--fsdp); launch without --deepspeed, or drop --fsdp"
            )
        self.deepspeed = launched

    def _take_launched_fsdp(self) -> None:
        """``trainer-ext launch --fsdp_config FILE script.py``: arguments that ask for neither FSDP nor DeepSpeed train
        with the launch's FSDP2 settings, as transformers' Trainer does under ``accelerate launch --use_fsdp``."""
        launched = os.environ.get(env_vars.FSDP_CONFIG)
        if not launched or fsdp_requested(self.fsdp):
            return
        if self.deepspeed:
            raise ConfigError(
                f"trainer-ext launch was given FSDP settings ({env_vars.FSDP_CONFIG}) and these arguments a DeepSpeed "
                "config (--deepspeed); launch without --fsdp_config, or drop --deepspeed"
            )
        self.fsdp, self.fsdp_config = True, launched_fsdp_settings()

    def _take_parallelism_config(self) -> None:
        """``parallelism_config`` (ours, accelerate's, a dict, or the launch's variables) as ours, its sizes checked
        against the launched processes and its layout against the backend asked for, before any process group."""
        config = mesh_setup.as_parallelism_config(self.parallelism_config)
        self.parallelism_config = config
        if config is None:
            return
        mesh_setup.check_parallelism(config, detect_topology().world_size, cpu=bool(self.use_cpu))
        if self.deepspeed:
            STRATEGIES["deepspeed"].check_parallelism(config)
        elif fsdp_requested(self.fsdp) or mesh_setup.shards_by_mesh(config):
            STRATEGIES["fsdp"].check_parallelism(config)

    def _process_fsdp_args(self) -> dict | None:
        """Read ``--fsdp``/``--fsdp_config`` (YAML or JSON; transformers' or accelerate's keys) without accelerate."""
        if not fsdp_requested(self.fsdp):
            self.fsdp = type(self).__dataclass_fields__["fsdp"].default
            return None
        return STRATEGIES["fsdp"].read_training_arguments(self)

    def _refuse_unsupported(self) -> None:
        self._refuse_combinations()
        if self.deepspeed and importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(
                "--deepspeed needs the deepspeed package: pip install 'deepspeed>=0.16' (on a machine without CUDA: "
                "DS_BUILD_OPS=0 pip install 'deepspeed>=0.16')"
            )

    def _refuse_combinations(self) -> None:
        """Flags that cannot go together, whatever is installed (``trainer-ext estimate`` checks these too)."""
        if self.deepspeed and fsdp_requested(self.fsdp):
            raise ConfigError(
                "--fsdp and --deepspeed both shard the model; choose one: FSDP2 (--fsdp --fsdp_config "
                "configs/fsdp/full_shard.yaml) or DeepSpeed ZeRO (--deepspeed configs/deepspeed/zero3.json)"
            )
        if self.auto_find_batch_size and (self.deepspeed or fsdp_requested(self.fsdp)):
            # DeepSpeed fixes its micro-batch and accumulation in its config; FSDP2 all-gathers in every forward, so
            # a rank that alone splits its micro-batch would wait for collectives the others never issue
            why = (
                "DeepSpeed fixes train_micro_batch_size_per_gpu and gradient_accumulation_steps in its config"
                if self.deepspeed
                else "each FSDP forward all-gathers, so ranks must run the same number of micro-batches"
            )
            raise ConfigError(
                f"--auto_find_batch_size is not supported with --{'deepspeed' if self.deepspeed else 'fsdp'} ({why}); "
                "set --per_device_train_batch_size and use --gradient_accumulation_steps to reach the global batch "
                "you want"
            )

    def _check_values(self) -> None:
        """Values transformers accepts but that fail later, mid-run, with a traceback."""
        problems = []
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"--{name} must be at least 1, got {value}")
        if self.learning_rate is not None and self.learning_rate < 0:
            problems.append(f"--learning_rate must not be negative, got {self.learning_rate}")
        if self.dataloader_num_workers is not None and self.dataloader_num_workers < 0:
            problems.append(f"--dataloader_num_workers must not be negative, got {self.dataloader_num_workers}")
        if self.torch_compile_backend:
            import torch._dynamo

            known = torch._dynamo.list_backends(exclude_tags=())
            if self.torch_compile_backend not in known:
                problems.append(
                    f"--torch_compile_backend {self.torch_compile_backend!r} is not a torch.compile backend; "
                    f"known: {', '.join(known)}"
                )
        if problems:
            raise ConfigError("; ".join(problems))

    def to_dict(self) -> dict:
        """transformers' ``to_dict``, with ``accelerator_config`` as a dict (upstream does it only with accelerate)."""
        values = super().to_dict()
        config = values.get("accelerator_config")
        if config is not None and not isinstance(config, (dict, str)) and hasattr(config, "to_dict"):
            values["accelerator_config"] = config.to_dict()
        return values

    # The distributed state belongs to the process that built it: a pickled copy (training_args.bin)
    # loaded elsewhere, e.g. by another rank, must set its own devices up again.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("_setup_devices", "distributed_state", "_n_gpu"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.distributed_state = None
        self._n_gpu = 0
        _ = self._setup_devices

    @cached_property
    def _setup_devices(self) -> torch.device:
        """Build our DistState (initialising the process group for several processes); return the device."""
        from datetime import timedelta

        self._take_configured_state()
        state = DistState(
            cpu=bool(self.use_cpu),
            backend=self.ddp_backend,
            timeout=timedelta(seconds=self.ddp_timeout),
        )
        self.distributed_state = state
        self._count_gpus()
        problem = process_group_mismatch()
        if problem is not None:
            logger.warning(problem)  # transformers warns here too (not DISTRIBUTED in a process group): in our words
        return state.device

    def _take_configured_state(self) -> None:
        """``accelerator_config`` ``use_configured_state``: consumed here, as transformers does; refused when nothing
        set this process's distributed state up before (our DistState then joins the process group that exists)."""
        self.accelerator_config = _compat.accelerator_config(self.accelerator_config)  # transformers' step 7
        if not self.accelerator_config.pop("use_configured_state", False):
            return
        if dist.is_available() and dist.is_initialized():
            return  # our DistState (an Accelerator's, earlier arguments'), accelerate's or the script's own group
        if accelerate_state_set_up():
            return  # a script's accelerate.PartialState/Accelerator: what transformers accepts
        raise ConfigError(
            "accelerator_config use_configured_state=True needs a distributed state set up before TrainingArguments "
            "and this process has none (no torch.distributed process group, no accelerate PartialState): drop "
            "use_configured_state (trainer_ext sets the devices up from the launcher's variables), or start the "
            "process group first (trainer_ext.Accelerator() in processes started by trainer-ext launch)"
        )

    def _claim_world(self, strategy: str) -> None:
        """The strategy's rules for this state's processes, and the process group it needs (FSDP on one launched
        process joins a group of world size 1, so ``parallel_mode`` is DISTRIBUTED as under accelerate)."""
        claim_world(self.distributed_state, strategy)
        self._count_gpus()

    def _count_gpus(self) -> None:
        """One GPU per process in a process group; several GPUs in one process use nn.DataParallel (transformers')."""
        state = self.distributed_state
        if state.device.type != "cuda":
            self._n_gpu = 0
        elif state.distributed_type != DistributedType.NO:
            self._n_gpu = 1
        else:
            self._n_gpu = torch.cuda.device_count()

    @property
    def parallel_mode(self) -> ParallelMode:
        """DISTRIBUTED for several processes (or one in a process group: FSDP); NOT_DISTRIBUTED for DataParallel;
        else NOT_PARALLEL."""
        state = getattr(self, "distributed_state", None)
        if state is not None and state.distributed_type != DistributedType.NO:
            return ParallelMode.DISTRIBUTED
        if self.n_gpu > 1:
            return ParallelMode.NOT_DISTRIBUTED
        return ParallelMode.NOT_PARALLEL


# transformers' own class, as our base: `trainer-ext launch --swap_trainer` rebinds the public name to ours
STOCK_TRAINING_ARGUMENTS: type = TrainingArguments.__bases__[0]
