"""ThroughputCallback: samples/s, tokens/s, MFU and peak memory in every training log line.

Counts come from a forward pre-hook on the model (training forwards only), summed over ranks at each logging step;
the time is the training time of the window — from the end of one optimizer step to the end of the next (data loading
included), except that after an evaluation or a checkpoint save the clock restarts at the next step's start — the
longest of the ranks. Tokens are the positions the model processed, padding
included (that is what the FLOPs are spent on).

FLOPs per token (training, forward + backward) = 6·N + 12·L·d·T: N the parameters that take part in matrix products
(embedding lookups excluded, a tied output head counted once), L layers, d hidden size, T the batch's sequence length
(the attention-score term; left out when the model has no ``config`` with ``num_hidden_layers``/``hidden_size``).
It assumes every weight is trained. MFU = FLOPs/s over all ranks / (world size × peak FLOPs of one device); the peak is
the dense bf16 tensor-core figure from :data:`PEAK_BF16_FLOPS`, or ``peak_flops`` — on CPU there is none by default.
"""

from __future__ import annotations

import resource
import sys
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from transformers import DefaultFlowCallback, TrainerCallback

from trainer_ext.callbacks._log_entry import add_to_log

# Dense (no sparsity) bf16/fp16 tensor-core peaks from NVIDIA's data sheets; the first entry whose words all appear in
# torch.cuda.get_device_name() wins ("NVIDIA H100 80GB HBM3" is the SXM part).
PEAK_BF16_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H100", "PCIe"), 756e12),
    (("H100", "NVL"), 835e12),
    (("H200", "NVL"), 835e12),
    (("H100",), 989e12),
    (("H200",), 989e12),
    (("GH200",), 989e12),
    (("A100",), 312e12),
    (("A10",), 125e12),
    (("L40S",), 362e12),
    (("L4",), 121e12),
)


def lookup_peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a GPU from its name, or None when it is not in the table."""
    words = set(device_name.replace("-", " ").split())
    return next((flops for needed, flops in PEAK_BF16_FLOPS if set(needed) <= words), None)


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters used in matrix products: all but embedding tables (a table reused as output head counts once)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    reused = {
        id(p) for m in model.modules() if not isinstance(m, torch.nn.Embedding) for p in m.parameters(recurse=False)
    }
    return sum(p.numel() for p in model.parameters() if id(p) not in tables or id(p) in reused)


def flops_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(N, L, d) of the FLOPs formula; L and d are 0 when the model's config does not give them."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    layers, hidden = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
    return matmul_params(model), int(layers or 0), int(hidden or 0)


def training_flops_per_token(shape: tuple[int, int, int], seq_len: int) -> float:
    """6·N + 12·L·d·T for one token of a training step (forward and backward) at sequence length ``seq_len``."""
    params, layers, hidden = shape
    return 6 * params + 12 * layers * hidden * seq_len


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory so far: allocated CUDA memory on a GPU, else the process's maximum resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


class ThroughputCallback(TrainerCallback):
    """Adds ``samples_per_second``, ``tokens_per_second``, ``mfu`` and ``peak_memory_mib`` to training logs.

    Pass the trainer (``ThroughputCallback(trainer)``) so that the callback moves itself ahead of the ``report_to``
    integrations, which then receive these values too; without it they reach ``state.log_history`` and the
    printer/progress bar only. ``flops_per_token`` overrides the formula; ``peak_flops`` the table.
    """

    def __init__(
        self, trainer: Any = None, *, peak_flops: float | None = None, flops_per_token: float | None = None
    ) -> None:
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        self.peak_flops = peak_flops
        self.flops_per_token = flops_per_token
        self.last_window: dict[str, float] = {}  # summed over ranks, at the last logging step
        self._hook: Any = None
        self._shape = (0, 0, 0)
        self._reset()
        self._mark, self._interrupted = time.perf_counter(), False

    def _reset(self) -> None:
        self._samples, self._tokens, self._flops, self._seconds = 0, 0, 0.0, 0.0

    def _count(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not module.training:
            return
        main = kwargs.get(getattr(module, "main_input_name", "input_ids"))
        first = main if main is not None else next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a)), None)
        if first is None:
            return
        batch = first.shape[0] if first.ndim else 1
        self._samples += batch
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        if ids is None and main is not None and main.ndim == 2 and not main.is_floating_point():
            ids = main
        shape = ids.shape if ids is not None and ids.ndim == 2 else embeds.shape[:2] if embeds is not None else None
        if shape is not None:
            tokens = shape[0] * shape[1]
            self._tokens += tokens
            per_token = self.flops_per_token or training_flops_per_token(self._shape, shape[1])
            self._flops += tokens * per_token

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is not None:
            callbacks = trainer.callback_handler.callbacks
            first = 1 if callbacks and isinstance(callbacks[0], DefaultFlowCallback) else 0
            if callbacks.index(self) > first:
                # moving an already visited callback forward is safe while the handler iterates this list
                callbacks.insert(first, callbacks.pop(callbacks.index(self)))
        if self._hook is not None:
            self._hook.remove()
        self._hook = None
        if model is not None:
            self._shape = flops_shape(model)
            self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)
        self._reset()
        self._mark, self._interrupted = time.perf_counter(), False

    def on_step_begin(self, args, state, control, **kwargs):
        if self._interrupted:  # resume the clock after an evaluation or a save (whichever callback ran last)
            self._mark, self._interrupted = time.perf_counter(), False

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_log and args.device.type == "cuda":
            torch.cuda.synchronize(args.device)
        now = time.perf_counter()
        self._seconds += now - self._mark
        self._mark = now

    def on_evaluate(self, args, state, control, **kwargs):
        self._interrupted = True  # evaluation time is not training time

    def on_save(self, args, state, control, **kwargs):
        self._interrupted = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:  # training log lines only (every rank has them at the same steps)
            return
        sums = torch.tensor([self._samples, self._tokens, self._flops], dtype=torch.float64, device=args.device)
        maxes = torch.tensor([self._seconds, peak_memory_mib(args.device)], dtype=torch.float64, device=args.device)
        world = 1
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
            world = dist.get_world_size()
        samples, tokens, flops = sums.tolist()
        seconds, memory = maxes.tolist()
        self.last_window = {"samples": samples, "tokens": tokens, "flops": flops, "seconds": seconds}
        self._reset()
        values: dict[str, float] = {"peak_memory_mib": round(memory, 1)}
        if seconds > 0 and samples > 0:
            values["samples_per_second"] = round(samples / seconds, 3)
            if tokens > 0:
                values["tokens_per_second"] = round(tokens / seconds, 3)
            peak = self.peak_flops if self.peak_flops is not None else _device_peak(args.device)
            if peak and flops > 0:
                values["mfu"] = round(flops / seconds / (peak * world), 5)
        add_to_log(state, logs, values)

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _device_peak(device: torch.device) -> float | None:
    return lookup_peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
