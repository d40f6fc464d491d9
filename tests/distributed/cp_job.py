"""Rank job: a tiny float64 Llama (SDPA) trained, resumed, exported and evaluated through the Trainer under context
parallelism on a mesh of all ranks, and packed against unpacked documents; rank 0 writes what it saw to
``OUT/NAME.pt``.

    python -m torch.distributed.run --nproc_per_node 4 -m tests.distributed.cp_job OUT 2,2,1 train eval

SIZES is ``cp,dp_shard,tp`` (``1,1,1``: one process, no ``parallelism_config``). Every training run has the global
batch of :data:`GLOBAL_BATCH` ragged, right-padded rows per optimizer step, whatever the mesh: per-device batches of
:data:`PER_DEVICE` and ``GLOBAL_BATCH // (PER_DEVICE × dp_shard)`` accumulation steps (the ``cp`` and ``tp`` ranks
of one group read one batch).

Tasks:
- ``train``: :data:`STEPS` Trainer steps (clipping at 0.5), ``checkpoint-5`` saved; the export reloaded with
  ``from_pretrained`` on rank 0 against the in-memory logits;
- ``same_mesh``: a fresh Trainer resumed from the ``train`` task's checkpoint-5;
- ``from=DIR``: a fresh Trainer resumed from ``DIR/train/checkpoint-5`` (written on another mesh);
- ``eval``: the trained model's ``eval_loss`` (exact and mean of batch means) and ``predict`` on 13 ragged rows in
  batches of 3, and ``gather_for_metrics`` of each eval batch's lengths;
- ``packed`` / ``unpacked``: :data:`PACKED_STEPS` SGD steps on the same documents packed into one row per device
  batch (``DataCollatorWithFlattening``) or one right-padded row each (:func:`unpacked`);
- ``packed_args_cache``: ``packed`` with ``TrainingArguments(use_cache=True)`` (the model's config then asks for a
  key/value cache, which our Trainer turns off for packed batches);
- ``packed_cache``: ``packed`` with ``use_cache=True`` in every batch, which the Trainer leaves as it is (the cache
  keeps transformers from building the block mask of packed documents: they attend across their boundaries).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening

from tests.distributed.nd_job import save, trained
from tests.distributed.tensor_parallel_job import tiny_model
from tests.helpers.tiny import pad_right, ragged_lm_dataset
from trainer_ext import Trainer, TrainingArguments
from trainer_ext.distributed.mesh.config import ParallelismConfig

GLOBAL_BATCH, PER_DEVICE, STEPS, SAVE_AT, CLIP = 8, 2, 10, 5, 0.5
DTYPE = torch.float64
EVAL_ROWS, EVAL_BATCH = 13, 3
PACKED_DOCS, PACKED_PER_DEVICE, PACKED_ACCUMULATION, PACKED_STEPS = 18, 3, 2, 3
PROBE = torch.arange(3, 17).reshape(1, 14)


def sizes(text: str) -> tuple[int, int, int]:
    cp, shard, tp = (int(n) for n in text.split(","))
    return cp, shard, tp


def config(text: str) -> ParallelismConfig | None:
    cp, shard, tp = sizes(text)
    if cp * shard * tp == 1:
        return None
    return ParallelismConfig(cp_size=cp, dp_shard_size=shard, tp_size=tp)


def model() -> torch.nn.Module:
    """The tiny Llama in float64 on SDPA (the attention context parallelism computes with)."""
    built = tiny_model("llama", DTYPE)
    built.config._attn_implementation = "sdpa"
    return built


def arguments(out: Path, text: str, per_device: int, accumulation: int, **overrides) -> TrainingArguments:
    settings = dict(
        output_dir=str(out),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        per_device_eval_batch_size=EVAL_BATCH,
        max_steps=STEPS,
        learning_rate=1e-3,
        max_grad_norm=CLIP,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        use_cpu=True,
        parallelism_config=config(text),
    )
    return TrainingArguments(**{**settings, **overrides})


def trainer(out: Path, text: str) -> Trainer:
    """:data:`GLOBAL_BATCH` rows per step: ``cp`` and ``tp`` ranks share a batch, ``dp_shard`` ranks split it."""
    _, shard, _ = sizes(text)
    accumulation = GLOBAL_BATCH // (PER_DEVICE * shard)
    args = arguments(out, text, PER_DEVICE, accumulation, save_strategy="steps", save_steps=SAVE_AT)
    data = ragged_lm_dataset(GLOBAL_BATCH * STEPS, seed=1)
    return Trainer(model=model(), args=args, train_dataset=data, data_collator=pad_right)


def unpacked(features: list[dict]) -> dict[str, torch.Tensor]:
    """One right-padded row per document, labelled as ``DataCollatorWithFlattening`` labels it: -100 on each
    document's first token."""
    batch = pad_right(features)
    batch["labels"][:, 0] = -100
    return batch


def with_cache(features: list[dict]) -> dict:
    return {**DataCollatorWithFlattening()(features, return_tensors="pt"), "use_cache": True}


# task -> (data collator, TrainingArguments overrides)
PACKINGS = {
    "packed": (DataCollatorWithFlattening(), {}),
    "unpacked": (unpacked, {}),
    "packed_args_cache": (DataCollatorWithFlattening(), {"use_cache": True}),
    "packed_cache": (with_cache, {}),
}


def packing_trainer(out: Path, text: str, packing: str) -> Trainer:
    collator, overrides = PACKINGS[packing]
    args = arguments(
        out / packing,
        text,
        PACKED_PER_DEVICE,
        PACKED_ACCUMULATION,
        max_steps=PACKED_STEPS,
        optim="sgd",
        learning_rate=0.1,
        lr_scheduler_type="constant",
        **overrides,
    )
    data = ragged_lm_dataset(PACKED_DOCS, seed=3)
    return Trainer(model=model(), args=args, train_dataset=data, data_collator=collator)


def logits(net: torch.nn.Module) -> torch.Tensor:
    net.eval()
    with torch.no_grad():
        got = net(input_ids=PROBE).logits
    net.train()
    return got.full_tensor() if isinstance(got, DTensor) else got


def train_task(out: Path, text: str) -> Trainer:
    tr = trainer(out / "train", text)
    seen = trained(tr)
    tr.save_model(str(out / "export"))
    in_memory = logits(tr.model_wrapped)
    if not dist.is_initialized() or dist.get_rank() == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(str(out / "export"))
        seen["export_files"] = sorted(os.listdir(out / "export"))
        seen["export_attention"] = reloaded.config._attn_implementation
        seen["export_dtype"] = str(next(reloaded.parameters()).dtype)
        seen["export_diff"] = (logits(reloaded) - in_memory).abs().max().item()
    save(out, "train", seen)
    return tr


def eval_task(out: Path, tr: Trainer) -> None:
    data = ragged_lm_dataset(EVAL_ROWS, seed=7)
    seen = {"rows": data["input_ids"]}
    for exact in (True, False):
        tr.args.exact_eval_loss = exact
        seen[f"eval_loss_{exact}"] = tr.evaluate(data)["eval_loss"]
    predicted = tr.predict(data)
    seen["predictions"], seen["label_ids"] = torch.as_tensor(predicted.predictions), predicted.label_ids.tolist()
    lengths = [tr.accelerator.gather_for_metrics(b["attention_mask"].sum(1)) for b in tr.get_eval_dataloader(data)]
    seen["lengths"] = torch.cat(lengths).tolist()
    save(out, "eval", seen)


def main(out: str, text: str, *tasks: str) -> None:
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    done = None  # the trained Trainer, evaluated by ``eval``
    for task in tasks:
        if task == "train":
            done = train_task(root, text)
        elif task == "eval":
            eval_task(root, done)
        elif task == "same_mesh":
            checkpoint = str(root / "train" / f"checkpoint-{SAVE_AT}")
            save(root, "same_mesh", trained(trainer(root / "same_mesh", text), checkpoint))
        elif task.startswith("from="):
            source = Path(task.removeprefix("from=")) / "train" / f"checkpoint-{SAVE_AT}"
            save(root, "from", trained(trainer(root / "from", text), str(source)))
        elif task in PACKINGS:
            save(root, task, trained(packing_trainer(root, text, task)))
        else:
            raise SystemExit(f"unknown task {task!r}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
