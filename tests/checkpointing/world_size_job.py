"""``Accelerator.save_state`` on one number of processes, ``load_state`` on another (test_loop_state_world_size.py).

The global batch stays 12 samples whatever the number of processes: per-device batch 2 x accumulation
``12 / (2 x processes)`` (1 process: 6, 2: 3, 3: 2), so an optimizer step reads the same 12 samples and averages
the same losses everywhere. The loader's sampler has its own seeded generator, which orders the passes alike on
every number of processes. Each run writes, from its main process, its final weights (``NAME.safetensors``) and
``NAME.json``: the samples of each optimizer step (rows, sorted) and what ``load_state`` logged on each rank.
``shuffle="plain"`` runs take a ``shuffle=True`` loader instead; ``stream`` runs an iterable dataset, ``refused``
DeepSpeed.

``python -m tests.checkpointing.world_size_job OUT PHASE`` under torchrun runs a phase's runs on every rank.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, RandomSampler
from transformers import default_data_collator

from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Accelerator

SAMPLES, BATCH, GLOBAL, EPOCHS, STOP = 48, 2, 12, 2, 3  # 4 optimizer steps an epoch; the save after step 3
FSDP = {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}


class Lines(logging.Handler):
    """What trainer_ext's loggers said on this rank (info and above)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname}: {record.getMessage()}")


def _all_ranks(value: object, accelerator: Accelerator) -> list:
    if accelerator.num_processes == 1:
        return [value]
    values: list = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(values, value)
    return values


def _weights(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = accelerator.get_state_dict(model)  # gathered on the main process for a sharded model
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


def run(
    out: Path,
    name: str,
    *,
    fsdp: bool = False,
    stop: bool = False,
    resume: str | None = None,
    shuffle: str = "generator",
) -> None:
    """The accelerate-example loop; ``stop``: save_state after optimizer step STOP into ``out/name`` and return.

    ``shuffle="generator"``: a RandomSampler with its own seeded generator; ``"plain"``: ``shuffle=True``.
    """
    handler, logger = Lines(), logging.getLogger("trainer_ext")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        accumulation = GLOBAL // (BATCH * int(os.environ.get("WORLD_SIZE", "1")))
        accelerator = Accelerator(
            cpu=True, gradient_accumulation_steps=accumulation, seed=0, fsdp_config=FSDP if fsdp else None
        )
        model = tiny_llama(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        data = lm_dataset(SAMPLES, seed=5).with_format("torch")
        if shuffle == "generator":
            sampler = RandomSampler(data, generator=torch.Generator().manual_seed(7))
            loader = DataLoader(data, batch_size=BATCH, sampler=sampler, collate_fn=default_data_collator)
        else:
            loader = DataLoader(data, batch_size=BATCH, shuffle=True, collate_fn=default_data_collator)
        # a constant rate: how often a scheduler steps per optimizer step may depend on the number of processes
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        start = 0
        if resume is not None:
            accelerator.load_state(out / resume)
            start = loader.state_dict()["epoch"]

        def batches():
            for epoch in range(start, EPOCHS):
                loader.set_epoch(epoch)  # a resumed loader keeps its pending skip: it continues mid-epoch
                yield from loader

        steps: list[list[list[int]]] = []
        window: list[list[int]] = []
        model.train()
        for batch in batches():
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            window.extend(batch["input_ids"].tolist())
            if accelerator.sync_gradients:
                steps.append(sorted(row for rows in _all_ranks(window, accelerator) for row in rows))
                window = []
                if stop and len(steps) == STOP:
                    accelerator.save_state(out / name)
                    break
        weights = _weights(accelerator, model)
        warnings = _all_ranks(handler.lines, accelerator)
        if accelerator.is_main_process:
            save_file(weights, str(out / f"{name}.safetensors"))
            (out / f"{name}.json").write_text(json.dumps({"steps": steps, "log": warnings}))
        accelerator.wait_for_everyone()  # the process group stays for the phase's next run (torchrun's store is
        # not made for a second rendezvous); it is torn down at exit
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        gc.collect()


class Stream(torch.utils.data.IterableDataset):
    """The numbers 0..47 as one-column rows: a stream, whose loader position counts batches of its world size."""

    def __iter__(self):
        return iter([{"x": torch.tensor([i])} for i in range(SAMPLES)])


def stream(out: Path, name: str, resume: str | None = None) -> None:
    """Read 3 batches of a stream and save (``resume=None``), or load ``resume`` and record the next batch."""
    handler, logger = Lines(), logging.getLogger("trainer_ext")
    logger.addHandler(handler)
    try:
        accelerator = Accelerator(cpu=True, seed=0)
        loader = accelerator.prepare(DataLoader(Stream(), batch_size=BATCH))
        if resume is None:
            for i, _ in enumerate(loader):
                if i == 2:
                    accelerator.save_state(out / name)
                    break
            return
        accelerator.load_state(out / resume)
        first = next(iter(loader))["x"].flatten().tolist()
        warnings = _all_ranks(handler.lines, accelerator)
        if accelerator.is_main_process:
            (out / f"{name}.json").write_text(json.dumps({"first": first, "log": warnings}))
    finally:
        logger.removeHandler(handler)


def refused(out: Path, name: str, resume: str | None) -> None:
    """DeepSpeed ZeRO-2: save after one step into ``out/name`` (``resume=None``), or load ``resume`` and record
    the error (None when it loaded)."""
    from tests.helpers.paths import CONFIGS

    accelerator = Accelerator(cpu=True, seed=0, deepspeed_config=str(CONFIGS / "deepspeed" / "zero2.json"))
    model = tiny_llama(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    loader = DataLoader(lm_dataset(8).with_format("torch"), batch_size=BATCH, collate_fn=default_data_collator)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if resume is None:
        accelerator.backward(model(**next(iter(loader))).loss)
        optimizer.step()
        accelerator.save_state(out / name)
        return
    message = None
    try:
        accelerator.load_state(out / resume)
    except Exception as error:  # reported to the test
        message = f"{type(error).__name__}: {error}"
    if accelerator.is_main_process:
        (out / f"{name}.json").write_text(json.dumps({"refused": message}))


PHASES = {
    # 2 processes: the references and the saves of DDP and FSDP, and the runs resumed from 1 process's save
    "two": lambda out: [
        run(out, "ddp2_full"),
        run(out, "ddp2_saved", stop=True),
        run(out, "fsdp2_full", fsdp=True),
        run(out, "fsdp2_saved", fsdp=True, stop=True),
        run(out, "one_to_two", resume="one_saved"),
        run(out, "fsdp_one_to_two", fsdp=True, resume="one_saved"),
        run(out, "plain2_full", shuffle="plain"),
        run(out, "plain2_saved", stop=True, shuffle="plain"),
        stream(out, "stream2_saved"),
    ],
    # 3 processes: DDP and FSDP resumed from 2 processes' saves
    "three": lambda out: [
        run(out, "ddp_two_to_three", resume="ddp2_saved"),
        run(out, "fsdp_two_to_three", fsdp=True, resume="fsdp2_saved"),
    ],
    "deepspeed_save": lambda out: [refused(out, "ds2_saved", None)],
    "deepspeed_load": lambda out: [refused(out, "ds_refused", "ds2_saved")],
}


if __name__ == "__main__":
    PHASES[sys.argv[2]](Path(sys.argv[1]))
