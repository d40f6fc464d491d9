"""Rank job: a tiny Llama (and a tiny Qwen2) trained, resumed, exported and evaluated through the Trainer and a
hand-written Accelerator loop on an N-D mesh of all ranks; rank 0 writes what it saw to ``OUT/NAME.pt``.

    python -m torch.distributed.run --nproc_per_node 4 -m tests.distributed.nd_job OUT 1,2,2 train eval loop

SIZES is ``dp_replicate,dp_shard,tp`` (``1,1,1``: one process, no ``parallelism_config``); models are float64.
Every Trainer run has the global
batch of :data:`GLOBAL_BATCH` sequences per optimizer step, whatever the mesh: per-device batches of 2 and
``GLOBAL_BATCH // (2 × data-parallel ranks)`` accumulation steps (the ranks of one TP group read one batch).

Tasks:
- ``train``: 10 Trainer steps (clipping at 0.5), ``checkpoint-5`` saved; the consolidated export reloaded with
  ``from_pretrained`` on rank 0 against the in-memory logits;
- ``same_mesh``: a fresh Trainer resumed from the ``train`` task's checkpoint-5;
- ``from=DIR``: a fresh Trainer resumed from ``DIR/train/checkpoint-5`` (written on another mesh);
- ``qwen2``: 10 Trainer steps of a tiny Qwen2;
- ``eval``: the trained model's ``eval_loss`` (exact and mean of batch means) and ``predict`` on 13 ragged rows in
  batches of 3, and ``gather_for_metrics`` of each eval batch's lengths;
- ``loop``: 10 Accelerator steps of a global batch of :data:`LOOP_BATCH` (accumulate, ``clip_grad_norm_``, AdamW) with ``save_state`` after step 5, then
  ``load_state`` and steps 6-10 again; the mesh and this rank's coordinates.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from tests.distributed.tensor_parallel_job import tiny_model
from tests.helpers.tiny import lm_dataset, pad_right, ragged_lm_dataset
from trainer_ext import Accelerator, Trainer, TrainingArguments
from trainer_ext.distributed.mesh.config import ParallelismConfig

GLOBAL_BATCH, PER_DEVICE, LOOP_BATCH, STEPS, SAVE_AT, CLIP = 16, 2, 8, 10, 5, 0.5
DTYPE = torch.float64
EVAL_ROWS, EVAL_BATCH = 13, 3
PROBE = torch.arange(3, 15).reshape(1, 12)


def sizes(text: str) -> tuple[int, int, int]:
    replicate, shard, tp = (int(n) for n in text.split(","))
    return replicate, shard, tp


def config(text: str) -> ParallelismConfig | None:
    replicate, shard, tp = sizes(text)
    if replicate * shard * tp == 1:
        return None
    return ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard, tp_size=tp)


def accumulation(text: str) -> int:
    """Accumulation steps that keep :data:`GLOBAL_BATCH`: ranks of one TP group share their batches."""
    replicate, shard, _ = sizes(text)
    return GLOBAL_BATCH // (PER_DEVICE * replicate * shard)


def trainer(out: Path, text: str, arch: str = "llama", **overrides) -> Trainer:
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=accumulation(text),
        per_device_eval_batch_size=EVAL_BATCH,
        max_steps=STEPS,
        learning_rate=1e-3,
        max_grad_norm=CLIP,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_AT,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        use_cpu=True,
        parallelism_config=config(text),
        **overrides,
    )
    return Trainer(model=tiny_model(arch, DTYPE), args=args, train_dataset=lm_dataset(96), data_collator=pad_right)


def full(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sd.items()}


def trained(tr: Trainer, resume: str | None = None) -> dict:
    """Train ``tr`` (from ``resume``); its logged losses and gradient norms and its full weights."""
    tr.train(resume_from_checkpoint=resume)
    history = tr.state.log_history
    return {
        "losses": [h["loss"] for h in history if "loss" in h],
        "norms": [h["grad_norm"] for h in history if "grad_norm" in h],
        "steps": tr.state.global_step,
        "weights": full(tr.accelerator.get_state_dict(tr.model_wrapped)),
    }


def save(out: Path, name: str, seen: dict) -> None:
    if dist.get_rank() == 0 if dist.is_initialized() else True:
        torch.save(seen, out / f"{name}.pt")


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        got = model(input_ids=PROBE).logits
    model.train()
    return got.full_tensor() if isinstance(got, DTensor) else got


def train_task(out: Path, text: str) -> Trainer:
    tr = trainer(out / "train", text)
    seen = trained(tr)
    tr.save_model(str(out / "export"))
    in_memory = logits(tr.model_wrapped)
    if not dist.is_initialized() or dist.get_rank() == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(str(out / "export"), attn_implementation="eager")
        seen["export_files"] = sorted(os.listdir(out / "export"))
        seen["export_diff"] = (logits(reloaded) - in_memory).abs().max().item()
    save(out, "train", seen)
    return tr


def eval_task(out: Path, text: str, tr: Trainer) -> None:
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


def loop_task(out: Path, text: str) -> None:
    replicate, shard, tp = sizes(text)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, parallelism_config=config(text))
    model = tiny_model("llama", DTYPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(
        lm_dataset(96).with_format("torch"), batch_size=LOOP_BATCH // (2 * replicate * shard), shuffle=False
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = list(loader)

    def steps(first: int) -> tuple[list[float], list[float]]:
        losses, norms = [], []
        for batch in batches[2 * first : 2 * STEPS]:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
                optimizer.step()
                optimizer.zero_grad()
            losses.append(float(accelerator.reduce(loss.detach(), "mean")))
            if len(norms) == SAVE_AT and first == 0 and accelerator.sync_gradients:
                accelerator.save_state(str(out / "loop_state"))
        return losses, norms

    losses, norms = steps(0)
    seen = {"losses": losses, "norms": norms, "weights": full(accelerator.get_state_dict(model))}
    mesh = accelerator.torch_device_mesh
    seen["mesh"] = None if mesh is None else (list(mesh.mesh_dim_names), list(mesh.shape))
    ranks = {}
    for name in ("tensor_parallel_rank", "data_parallel_shard_rank", "data_parallel_rank"):
        try:
            ranks[name] = getattr(accelerator, name)
        except RuntimeError as error:
            ranks[name] = str(error)
    seen["ranks"] = [ranks] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(seen["ranks"], ranks)
    accelerator.load_state(str(out / "loop_state"))
    seen["resumed"] = steps(SAVE_AT)
    seen["resumed_weights"] = full(accelerator.get_state_dict(model))
    save(out, "loop", seen)


def main(out: str, text: str, *tasks: str) -> None:
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    done = None  # the trained Trainer, evaluated by ``eval``
    for task in tasks:
        if task == "train":
            done = train_task(root, text)
        elif task == "eval":
            eval_task(root, text, done)
        elif task == "same_mesh":
            checkpoint = str(root / "train" / f"checkpoint-{SAVE_AT}")
            save(root, "same_mesh", trained(trainer(root / "same_mesh", text), checkpoint))
        elif task.startswith("from="):
            source = Path(task.removeprefix("from=")) / "train" / f"checkpoint-{SAVE_AT}"
            save(root, "from", trained(trainer(root / "from", text), str(source)))
        elif task == "qwen2":
            save(root, "qwen2", trained(trainer(root / "qwen2", text, "qwen2")))
        elif task == "loop":
            loop_task(root, text)
        else:
            raise SystemExit(f"unknown task {task!r}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
