"""Rank job: hand-written ``trainer_ext.Accelerator`` loops under pipeline parallelism (``trainer_ext.pipeline_step``
and ``pipeline_eval_step``) or, on one process, the same loop on the plain model; rank 0 writes what it saw to
``OUT/NAME.pt``.

    python -m torch.distributed.run --nproc_per_node 4 -m tests.distributed.pp_loop_job OUT 2,2 1f1b counted

SIZES is ``pp,dp_shard`` (``1,1``: one process, no ``parallelism_config``, the plain model and
``accelerator.backward``); SCHEDULE is the ``pp_schedule`` (its default microbatch count). The model is a tiny
float64 Llama (4 layers, untied embeddings) on SDPA. Every optimizer step accumulates :data:`ACCUMULATION` global
micro-batches of :data:`MICRO_BATCH` ragged, right-padded rows (``MICRO_BATCH // dp_shard`` per data-parallel rank;
the pp ranks of a group read one batch).

Tasks:
- ``counted``: :data:`STEPS` optimizer steps (``accumulate``, ``clip_grad_norm_``, AdamW), the loss over the label
  tokens of the accumulation window on every data-parallel rank (``num_items_in_batch``); ``save_state`` after step
  :data:`SAVE_AT`, then a fresh Accelerator, model and optimizer ``load_state`` it and run steps 6-10 again; then
  the eval loop: ``pipeline_eval_step`` on every batch of an eval loader, logits through ``gather_for_metrics``;
- ``mean``: the same steps with each batch's token mean (no count: accelerate's ``accumulate`` convention);
- ``refusal``: ``pipeline_step`` on a model that is not split (one process).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tests.distributed.cp_loop_job import all_ranks
from tests.distributed.nd_job import full, save
from tests.helpers.tiny import VOCAB, pad_right, ragged_lm_dataset
from trainer_ext import Accelerator, ConfigError, ParallelismConfig, pipeline_eval_step, pipeline_step

MICRO_BATCH, ACCUMULATION, STEPS, SAVE_AT, CLIP, LR = 4, 2, 10, 5, 0.5, 1e-2
EVAL_ROWS, EVAL_BATCH, EVAL_LENGTH = 10, 2, 16  # 10 rows: with dp_shard 2 the last round is completed by repeats
DTYPE = torch.float64


def sizes(text: str) -> tuple[int, int]:
    pp, shard = (int(n) for n in text.split(","))
    return pp, shard


def config(text: str, schedule: str) -> ParallelismConfig | None:
    pp, shard = sizes(text)
    return None if pp * shard == 1 else ParallelismConfig(pp_size=pp, pp_schedule=schedule, dp_shard_size=shard)


def llama() -> torch.nn.Module:
    """4 decoder layers (two stages per rank under the interleaved schedules), untied, SDPA, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    cfg = LlamaConfig(
        vocab_size=VOCAB, num_hidden_layers=4, max_position_embeddings=64, attn_implementation="sdpa", **shape
    )
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(DTYPE)


# -- the loop ------------------------------------------------------------------------------------------
def setup(text: str, schedule: str) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer, list[dict]]:
    _, shard = sizes(text)
    accelerator = Accelerator(
        cpu=True, gradient_accumulation_steps=ACCUMULATION, parallelism_config=config(text, schedule)
    )
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    data = ragged_lm_dataset(MICRO_BATCH * ACCUMULATION * STEPS, seed=3)
    loader = DataLoader(data, batch_size=MICRO_BATCH // shard, collate_fn=pad_right)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return accelerator, model, optimizer, list(loader)


def window_tokens(accelerator: Accelerator, window: list[dict]) -> torch.Tensor:
    """The labelled tokens (after the shift) of an accumulation window on every data-parallel rank."""
    count = sum(batch["labels"][:, 1:].ne(-100).sum() for batch in window)
    if accelerator.num_processes == 1:
        return count
    return accelerator.reduce(count, "sum") // accelerator.parallelism_config.non_data_parallel_size


def step(accelerator: Accelerator, model: torch.nn.Module, batch: dict, count: torch.Tensor | None) -> float:
    """One micro-batch's forward and backward; returns its loss over every data-parallel rank."""
    if accelerator.parallelism_config is None:  # one process: the plain model
        loss = model(**batch, num_items_in_batch=count).loss
        accelerator.backward(loss if count is None else loss * ACCUMULATION)  # backward divides by the steps
        return loss.item()
    loss = pipeline_step(model, batch, accelerator, num_items_in_batch=count)
    if count is None:  # the batch mean: the same on each pp rank, averaged over the data-parallel ones
        return accelerator.reduce(loss, "mean").item()
    return accelerator.reduce(loss, "sum").item() / accelerator.parallelism_config.pp_size


def steps(accelerator, model, optimizer, batches, counted: bool, first: int, state: Path | None) -> tuple[list, list]:
    """Optimizer steps ``first + 1`` to :data:`STEPS`: each micro-batch's loss, each step's gradient norm."""
    losses, norms = [], []
    for index in range(first, STEPS):
        window = batches[ACCUMULATION * index : ACCUMULATION * (index + 1)]
        count = window_tokens(accelerator, window) if counted else None
        for batch in window:
            with accelerator.accumulate(model):
                losses.append(step(accelerator, model, batch, count))
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
                optimizer.step()
                optimizer.zero_grad()
        if state is not None and index + 1 == SAVE_AT:
            accelerator.save_state(str(state))
    return losses, norms


def pad_to_length(features: list[dict]) -> dict[str, torch.Tensor]:
    """:func:`pad_right` to :data:`EVAL_LENGTH` positions, so every rank's logits have one shape."""
    batch = pad_right(features)
    extra = EVAL_LENGTH - batch["input_ids"].shape[1]
    pads = {"input_ids": 0, "labels": -100, "attention_mask": 0}
    return {k: torch.nn.functional.pad(v, (0, extra), value=pads[k]) for k, v in batch.items()}


def evaluate(accelerator: Accelerator, model: torch.nn.Module) -> dict:
    """The eval loop: logits gathered with ``gather_for_metrics``, and each batch's loss (as rank 0 saw it)."""
    data = ragged_lm_dataset(EVAL_ROWS, seed=5)
    loader = accelerator.prepare(DataLoader(data, batch_size=EVAL_BATCH, collate_fn=pad_to_length))
    logits, losses = [], []
    for batch in loader:
        if accelerator.parallelism_config is None:
            model.eval()
            with torch.no_grad():
                outputs = model(**batch)
            loss, out = outputs.loss, outputs.logits
        else:
            loss, out = pipeline_eval_step(model, batch)
        logits.append(accelerator.gather_for_metrics(out))
        losses.append(loss.item())
    return {"logits": torch.cat(logits), "losses": losses}


def loop_task(out: Path, text: str, schedule: str, name: str) -> None:
    counted = name == "counted"
    accelerator, model, optimizer, batches = setup(text, schedule)
    state = out / f"{name}_state" if counted else None
    losses, norms = steps(accelerator, model, optimizer, batches, counted, 0, state)
    seen = {"losses": losses, "norms": norms, "weights": full(accelerator.get_state_dict(model))}
    if counted:
        try:
            rank = accelerator.pipeline_parallel_rank
        except NotImplementedError as error:
            rank = f"NotImplementedError: {error}"
        seen["ranks"] = all_ranks(rank)
        seen["eval"] = evaluate(accelerator, model)
        fresh, model, optimizer, batches = setup(text, schedule)
        fresh.load_state(str(state))
        seen["resumed"] = steps(fresh, model, optimizer, batches, counted, SAVE_AT, None)
        seen["resumed_weights"] = full(fresh.get_state_dict(model))
    save(out, name, seen)


def refusal_task(out: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(llama())
    batch = pad_right([{"input_ids": [3, 4, 5, 6]}])
    seen = {}
    for name, call in (
        ("step", lambda: pipeline_step(model, batch, accelerator)),
        ("eval", lambda: pipeline_eval_step(model, batch)),
    ):
        try:
            call()
            seen[name] = None
        except ConfigError as error:
            seen[name] = str(error)
    save(out, "refusal", seen)


def main(out: str, text: str, schedule: str, *tasks: str) -> None:
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        if task in ("counted", "mean"):
            loop_task(root, text, schedule, task)
        elif task == "refusal":
            refusal_task(root)
        else:
            raise SystemExit(f"unknown task {task!r}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
