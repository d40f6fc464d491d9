"""Rank job: hand-written ``trainer_ext.Accelerator`` loops under context parallelism, direct forward/backward parity
of the context-parallel attention, and the refusals; rank 0 writes what it saw to ``OUT/NAME.pt``.

    python -m torch.distributed.run --nproc_per_node 4 -m tests.distributed.cp_loop_job OUT 2,2 loop plain

SIZES is ``cp,dp_shard`` (``1,1``: one process, no ``parallelism_config``); the model is a tiny float64 Llama with
GQA (4 heads, 2 KV heads) on SDPA. Every loop step has a global micro-batch of :data:`MICRO_BATCH` ragged,
right-padded rows (``MICRO_BATCH // dp_shard`` per data-parallel rank; the ``cp`` ranks of a group read one batch),
two micro-batches per optimizer step.

Tasks:
- ``loop``: :data:`STEPS` optimizer steps (``accumulate``, ``clip_grad_norm_``, AdamW), the batch made by
  ``trainer_ext.context_parallel_batch`` (loss normalised by the global token count), ``save_state`` after step
  :data:`SAVE_AT`; then a fresh Accelerator, model and optimizer ``load_state`` it and run steps 6-10 again;
- ``manual``: the same loop with the pattern written out by hand (no helper);
- ``plain``: accelerate's pattern: ``loss = outputs.loss`` (each rank's mean over its own tokens);
- ``parity``: one forward/backward of a right-padded, a left-padded and a packed batch against the same model in
  this process alone: logits (joined over ``cp``, padding positions included) and every gradient;
- ``checkpointing`` / ``reentrant``: ``parity`` with activation checkpointing on the model (``use_reentrant`` False
  / True), backward inside the region, then with backward after the region has exited (the error recorded);
- ``refusals``: a sliding-window model refused by ``prepare`` and by the Trainer; a sequence length that does not
  split, and ``position_ids`` left out of the buffers, refused in the region; the Trainer pads odd lengths itself.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tests.distributed.nd_job import full, save
from tests.distributed.tensor_parallel_job import tiny_model
from tests.helpers.tiny import pad_right, ragged_lm_dataset
from trainer_ext import Accelerator, ConfigError, ParallelismConfig, context_parallel_batch
from trainer_ext.distributed.mesh.context_parallel import SequenceSplit

MICRO_BATCH, ACCUMULATION, STEPS, SAVE_AT, CLIP, LR = 4, 2, 10, 5, 0.5, 1e-3
DTYPE = torch.float64


def sizes(text: str) -> tuple[int, int]:
    cp, shard = (int(n) for n in text.split(","))
    return cp, shard


def config(text: str) -> ParallelismConfig | None:
    cp, shard = sizes(text)
    return None if cp * shard == 1 else ParallelismConfig(cp_size=cp, dp_shard_size=shard)


def llama() -> torch.nn.Module:
    model = tiny_model("llama", DTYPE)
    model.config._attn_implementation = "sdpa"  # what the context-parallel attention computes with
    return model


def all_ranks(value: object) -> list:
    """``value`` of every rank, in rank order."""
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


# -- loops -----------------------------------------------------------------------------------------
def setup(text: str) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer, list[dict]]:
    cp, shard = sizes(text)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION, parallelism_config=config(text))
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    data = ragged_lm_dataset(MICRO_BATCH * ACCUMULATION * STEPS, seed=3)
    loader = DataLoader(data, batch_size=MICRO_BATCH // shard, collate_fn=pad_right)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return accelerator, model, optimizer, list(loader)


def helper_step(accelerator: Accelerator, model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The pattern with ``context_parallel_batch``."""
    prepared = context_parallel_batch(batch, accelerator)
    with accelerator.maybe_context_parallel(
        buffers=prepared.buffers, buffer_seq_dims=[1] * len(prepared.buffers), no_restore_buffers=set(prepared.buffers)
    ):
        loss = model(**prepared.inputs).loss * prepared.loss_scale
        accelerator.backward(loss)
    return loss.detach() / prepared.loss_scale


def manual_step(accelerator: Accelerator, model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The pattern written out: shift_labels and position_ids before the split, pad to a multiple of 2·cp, the
    labelled tokens counted over the data-parallel ranks, the loss scaled by the ranks FSDP averages over."""
    pc = accelerator.parallelism_config
    cp = pc.cp_size if pc is not None else 1
    ranks = accelerator.num_processes // (pc.tp_size if pc is not None else 1)  # dp_replicate × dp_shard × cp
    batch = dict(batch)
    batch["shift_labels"] = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    rows, length = batch["input_ids"].shape
    batch["position_ids"] = torch.arange(length).expand(rows, -1)
    extra = -length % (2 * cp)
    pads = {"input_ids": 0, "labels": -100, "shift_labels": -100, "attention_mask": 0, "position_ids": 0}
    for key, value in pads.items():
        batch[key] = torch.nn.functional.pad(batch[key], (0, extra), value=value)
    count = batch["shift_labels"].ne(-100).sum()
    if accelerator.num_processes > 1:
        dist.all_reduce(count)
        count = count // pc.non_data_parallel_size  # the cp (and tp) ranks of a group counted the same batch
    buffers = [batch[key] for key in pads]
    with accelerator.maybe_context_parallel(
        buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
    ):
        loss = model(**batch, num_items_in_batch=count).loss * ranks
        accelerator.backward(loss)
    return loss.detach() / ranks


def plain_step(accelerator: Accelerator, model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """accelerate's pattern: the same split, ``outputs.loss`` as it comes (a mean over this rank's tokens)."""
    pc = accelerator.parallelism_config
    if pc is not None and pc.cp_size > 1:
        prepared = context_parallel_batch(batch, accelerator)
        inputs = {k: v for k, v in prepared.inputs.items() if k != "num_items_in_batch"}
        buffers = prepared.buffers
    else:
        inputs, buffers = batch, []
    with accelerator.maybe_context_parallel(
        buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
    ):
        loss = model(**inputs).loss
        accelerator.backward(loss)
    return loss.detach() / accelerator.num_processes


def steps(accelerator, model, optimizer, batches, step, first: int, out: Path | None = None) -> tuple[list, list]:
    """Optimizer steps ``first + 1`` to :data:`STEPS`: the global loss of each micro-batch, each step's norm."""
    losses, norms = [], []
    for batch in batches[ACCUMULATION * first : ACCUMULATION * STEPS]:
        with accelerator.accumulate(model):
            loss = step(accelerator, model, batch)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss, "sum")))
        if out is not None and accelerator.sync_gradients and len(norms) == SAVE_AT:
            accelerator.save_state(str(out))
    return losses, norms


def loop_task(out: Path, text: str, name: str) -> None:
    step = {"loop": helper_step, "manual": manual_step, "plain": plain_step}[name]
    accelerator, model, optimizer, batches = setup(text)
    state = out / f"{name}_state"
    losses, norms = steps(accelerator, model, optimizer, batches, step, 0, state if name == "loop" else None)
    seen = {"losses": losses, "norms": norms, "weights": full(accelerator.get_state_dict(model))}
    if name == "loop":
        mesh = accelerator.torch_device_mesh
        seen["mesh"] = None if mesh is None else (list(mesh.mesh_dim_names), list(mesh.shape))
        ranks = {}
        for attribute in ("context_parallel_rank", "data_parallel_shard_rank"):
            try:
                ranks[attribute] = getattr(accelerator, attribute)
            except RuntimeError as error:
                ranks[attribute] = str(error)
        seen["ranks"] = all_ranks(ranks)
        fresh, model, optimizer, batches = setup(text)
        fresh.load_state(str(state))
        seen["resumed"] = steps(fresh, model, optimizer, batches, step, SAVE_AT)
        seen["resumed_weights"] = full(fresh.get_state_dict(model))
    save(out, name, seen)


# -- direct parity of the attention -------------------------------------------------------------------
def padded_batch() -> dict[str, torch.Tensor]:
    """Three rows of 16, 11 and 5 tokens, right-padded."""
    rows = [list(range(3, 19)), list(range(20, 31)), list(range(40, 45))]
    return pad_right([{"input_ids": r} for r in rows])


def left_padded_batch() -> dict[str, torch.Tensor]:
    """The rows of :func:`padded_batch`, padded on the left (only the key padding mask keeps them from the pads)."""
    batch = padded_batch()
    lengths = batch["attention_mask"].sum(1)
    order = (torch.arange(16) - (16 - lengths)[:, None]) % 16  # each row rolled right by its padding
    return {key: value.gather(1, order) for key, value in batch.items()}


def packed_batch() -> dict[str, torch.Tensor]:
    """Two rows of 16 positions packing documents of 7 + 9 and 5 + 6 + 5 tokens (position_ids restart, no
    attention_mask), each document's first label -100 as DataCollatorWithFlattening makes it."""
    ids, positions, labels = [], [], []
    for lengths in ((7, 9), (5, 6, 5)):
        row_ids, row_positions, row_labels = [], [], []
        for i, n in enumerate(lengths):
            tokens = list(range(5 + 11 * i, 5 + 11 * i + n))
            row_ids += tokens
            row_positions += list(range(n))
            row_labels += [-100, *tokens[1:]]
        ids.append(row_ids)
        positions.append(row_positions)
        labels.append(row_labels)
    return {"input_ids": torch.tensor(ids), "position_ids": torch.tensor(positions), "labels": torch.tensor(labels)}


def forward_backward(accelerator, model, batch: dict, inside: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and logits (joined over ``cp``, unpadded) of one forward/backward; ``inside=False`` runs the backward
    after the region has exited."""
    prepared = context_parallel_batch(batch, accelerator)
    with accelerator.maybe_context_parallel(
        buffers=prepared.buffers, buffer_seq_dims=[1] * len(prepared.buffers), no_restore_buffers=set(prepared.buffers)
    ):
        outputs = model(**prepared.inputs, use_cache=False)
        loss = outputs.loss * prepared.loss_scale
        if inside:
            loss.backward()
    if not inside:
        loss.backward()
    cp = accelerator.torch_device_mesh["cp"]
    parts = [torch.empty_like(outputs.logits) for _ in range(cp.size())]
    dist.all_gather(parts, outputs.logits.detach().contiguous(), group=cp.get_group())
    logits = SequenceSplit(cp.size()).unshard(parts, 1)[:, : batch["input_ids"].shape[1]]
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp.get_group())
    return total / prepared.loss_scale, logits


def parity_task(out: Path, text: str, name: str) -> None:
    accelerator = Accelerator(cpu=True, parallelism_config=config(text))
    reference = llama()
    if name in ("checkpointing", "reentrant"):
        reference.activation_checkpointing_enable({"use_reentrant": name == "reentrant"})
    model = accelerator.prepare(copy.deepcopy(reference))
    model.train()
    seen = {}
    cases = [("padded", padded_batch(), True), ("left", left_padded_batch(), True), ("packed", packed_batch(), True)]
    if name in ("checkpointing", "reentrant"):
        cases += [("padded_outside", padded_batch(), False), ("packed_outside", packed_batch(), False)]
    for case, batch, inside in cases:
        expected = reference(**batch, use_cache=False)
        expected.loss.backward()
        try:
            loss, logits = forward_backward(accelerator, model, batch, inside)
        except Exception as error:  # recorded: what backward outside the region does
            seen[case] = {"error": f"{type(error).__name__}: {error}"}
            reference.zero_grad()
            model.zero_grad()
            continue
        grads = full({n: p.grad for n, p in accelerator.unwrap_model(model).named_parameters()})
        expected_grads = {n: p.grad for n, p in reference.named_parameters()}
        seen[case] = {
            "loss": abs(loss.item() - expected.loss.item()),
            "logits": (logits - expected.logits.detach()).abs().max().item(),  # padding positions too
            "grads": max((grads[n] - expected_grads[n]).abs().max().item() for n in grads),
            "grad_scale": max(g.abs().max().item() for g in expected_grads.values()),
        }
        reference.zero_grad()
        model.zero_grad()
    save(out, name, seen)


# -- refusals ------------------------------------------------------------------------------------------
def refusal(make) -> str | None:
    """The ConfigError ``make()`` raised (None when it raised none)."""
    try:
        make()
    except ConfigError as error:
        return str(error)
    return None


def sliding_window_model() -> torch.nn.Module:
    return tiny_model("mistral", DTYPE, sliding_window=8)


def refusals_task(out: Path, text: str) -> None:
    from tests.helpers.tiny import lm_dataset
    from trainer_ext import Trainer, TrainingArguments

    def trainer(model: torch.nn.Module, name: str, seq_len: int) -> Trainer:
        args = TrainingArguments(
            output_dir=str(out / name),
            per_device_train_batch_size=2,
            max_steps=2,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=True,
            parallelism_config=config(text),
        )
        return Trainer(model=model, args=args, train_dataset=lm_dataset(8, seq_len=seq_len))

    seen = {}
    refused = trainer(sliding_window_model(), "sliding", 8)
    seen["trainer"] = refusal(refused.train)
    seen["trainer_steps"] = refused.state.global_step
    odd = trainer(llama(), "odd", 7)  # 7 positions: the Trainer pads each batch to 8 itself
    odd.train()
    seen["odd_steps"] = odd.state.global_step
    seen["odd_losses"] = [h["loss"] for h in odd.state.log_history if "loss" in h]
    accelerator = Accelerator(cpu=True, parallelism_config=config(text))
    seen["prepare"] = refusal(lambda: accelerator.prepare(sliding_window_model()))
    ids = torch.arange(3, 9).reshape(1, 6)  # 6 positions do not split into 2·cp = 4 chunks

    def region(buffers: list[torch.Tensor]):
        return accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers))

    def enter(buffers: list[torch.Tensor]) -> None:
        with region(buffers):
            pass

    seen["length"] = refusal(lambda: enter([ids, ids.clone()]))
    model = accelerator.prepare(llama())
    ids = torch.arange(3, 11).reshape(1, 8)
    labels = ids.clone()

    def without_positions() -> None:
        with region([ids, labels]):
            model(input_ids=ids, labels=labels)

    seen["positions"] = refusal(without_positions)
    save(out, "refusals", seen)


def main(out: str, text: str, *tasks: str) -> None:
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        if task in ("loop", "manual", "plain"):
            loop_task(root, text, task)
        elif task in ("parity", "checkpointing", "reentrant"):
            parity_task(root, text, task)
        elif task == "refusals":
            refusals_task(root, text)
        else:
            raise SystemExit(f"unknown task {task!r}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
