"""Rank job: a tiny float64 Llama (SDPA, 4 layers, untied embeddings) trained, resumed, exported and evaluated
through the Trainer under pipeline parallelism on a mesh of all ranks, and the Trainer's pipeline refusals; rank 0
writes what it saw to ``OUT/NAME.pt``.

    python -m torch.distributed.run --nproc_per_node 4 -m tests.distributed.pp_job OUT 2,2,1f1b train eval

LAYOUT is ``pp,dp_shard,schedule`` (``1,1,…``: one process, no ``parallelism_config``; the schedule's default
microbatch count). Every training run has the global batch of :data:`GLOBAL_BATCH` ragged, right-padded rows per
optimizer step, whatever the mesh: per-device batches of :data:`PER_DEVICE` (a checkpoint moves to another number of
processes only with the same) and ``GLOBAL_BATCH // (PER_DEVICE × dp_shard)`` accumulation steps (the pp ranks of
one group read one batch).

Tasks:
- ``train``: :data:`STEPS` Trainer steps (clipping at :data:`CLIP`), ``checkpoint-5`` saved;
- ``export``: the trained model's ``save_model`` reloaded with ``from_pretrained`` on rank 0: its weights against
  the trained ones, its logits against the pipeline's own on :data:`PROBE`;
- ``eval``: the trained model's (an untrained one's without ``train``) ``eval_loss`` (exact and mean of batch means)
  and ``predict`` on :data:`EVAL_ROWS` ragged rows, global eval batches of :data:`EVAL_BATCH` (``EVAL_BATCH //
  dp_shard`` per rank);
- ``same_mesh``: a fresh Trainer resumed from the ``train`` task's checkpoint-5;
- ``from=DIR[@SCHEDULE]``: a fresh Trainer (on SCHEDULE if given) resumed from ``DIR/train/checkpoint-5``;
- ``refusals``: the ``ConfigError`` (type, message, steps taken) of a tied-embeddings Llama, a GPT-2, a Trainer
  subclass with its own ``compute_loss`` and a batch with a column the stages do not take.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from tests.distributed.nd_job import save, trained
from tests.distributed.tensor_parallel_job import tiny_model
from tests.helpers.tiny import VOCAB, pad_right, ragged_lm_dataset
from trainer_ext import Trainer, TrainingArguments
from trainer_ext.distributed.mesh.config import ParallelismConfig
from trainer_ext.errors import ConfigError

GLOBAL_BATCH, PER_DEVICE, STEPS, SAVE_AT, CLIP, LR = 8, 2, 10, 5, 0.5, 1e-2
DTYPE = torch.float64
EVAL_ROWS, EVAL_BATCH = 13, 4
PROBE = torch.arange(3, 17).reshape(1, 14)


def layout(text: str) -> tuple[int, int, str]:
    pp, shard, schedule = text.split(",")[:3]
    return int(pp), int(shard), schedule


def extras(text: str) -> dict[str, str]:
    """The options after the layout: ``tp=2`` (tensor parallel size), ``split=1`` (pp_split), ``ac`` (gradient
    checkpointing)."""
    return dict((item.partition("=")[0], item.partition("=")[2]) for item in text.split(",")[3:])


def config(text: str) -> ParallelismConfig | None:
    pp, shard, schedule = layout(text)
    more = extras(text)
    tp = int(more.get("tp") or 1)
    if pp * shard * tp == 1:
        return None
    split = [int(c) for c in more["split"].split("/")] if more.get("split") else None
    return ParallelismConfig(pp_size=pp, pp_schedule=schedule, dp_shard_size=shard, tp_size=tp, pp_split=split)


def model(tied: bool = False) -> torch.nn.Module:
    """4 decoder layers (4 stages for the schedules with 2 per rank), seeded, float64 on SDPA."""
    shape = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    built = AutoConfig.for_model(
        "llama", **shape, vocab_size=VOCAB, num_hidden_layers=4, max_position_embeddings=64, tie_word_embeddings=tied
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(built, attn_implementation="sdpa").to(DTYPE)


def trainer(out: Path, text: str, net: torch.nn.Module | None = None, cls: type = Trainer, **overrides) -> Trainer:
    _, shard, _ = layout(text)
    settings = dict(
        output_dir=str(out),
        per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=GLOBAL_BATCH // (PER_DEVICE * shard),
        per_device_eval_batch_size=EVAL_BATCH // shard,
        max_steps=STEPS,
        learning_rate=LR,
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
        gradient_checkpointing="ac" in extras(text),
    )
    args = TrainingArguments(**{**settings, **overrides})
    data = ragged_lm_dataset(GLOBAL_BATCH * STEPS, seed=1)
    return cls(model=model() if net is None else net, args=args, train_dataset=data, data_collator=pad_right)


def logits(tr: Trainer) -> torch.Tensor:
    """The trained model's logits on :data:`PROBE` through the Trainer's prediction step (the pipeline's forward
    schedule, on every rank)."""
    _, got, _ = tr.prediction_step(tr.model_wrapped, {"input_ids": PROBE}, prediction_loss_only=False)
    return got.detach().to("cpu")


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def export_task(out: Path, tr: Trainer, weights: dict[str, torch.Tensor]) -> None:
    tr.save_model(str(out / "export"))
    in_memory = logits(tr)
    if is_main():
        reloaded = AutoModelForCausalLM.from_pretrained(str(out / "export"))
        state = reloaded.state_dict()
        seen = {"files": sorted(os.listdir(out / "export")), "keys": sorted(state)}
        seen["unequal"] = [k for k, w in weights.items() if k not in state or not torch.equal(state[k], w)]
        reloaded.eval()
        with torch.no_grad():
            seen["logits_diff"] = (reloaded(input_ids=PROBE).logits - in_memory).abs().max().item()
        save(out, "export", seen)


def eval_task(out: Path, tr: Trainer) -> None:
    data = ragged_lm_dataset(EVAL_ROWS, seed=7)
    seen = {"rows": data["input_ids"]}
    for exact in (True, False):
        tr.args.exact_eval_loss = exact
        seen[f"eval_loss_{exact}"] = tr.evaluate(data)["eval_loss"]
    predicted = tr.predict(data)
    seen["predictions"], seen["label_ids"] = torch.as_tensor(predicted.predictions), predicted.label_ids.tolist()
    save(out, "eval", seen)


class OwnLoss(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN201
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def with_token_types(features: list[dict]) -> dict[str, torch.Tensor]:
    batch = pad_right(features)
    return {**batch, "token_type_ids": torch.zeros_like(batch["input_ids"])}


def refusals_task(out: Path, text: str) -> None:
    cases = {
        "tied": dict(net=model(tied=True)),
        "gpt2": dict(net=tiny_model("gpt2", DTYPE)),
        "compute_loss": dict(cls=OwnLoss),
        "columns": dict(),
    }
    seen = {}
    for name, kwargs in cases.items():
        tr = None
        try:
            tr = trainer(out / "refused" / name, text, **kwargs, save_strategy="no")
            if name == "columns":
                tr.data_collator = with_token_types
            tr.train()
            seen[name] = ("trained", "", tr.state.global_step)
        except ConfigError as error:
            seen[name] = (type(error).__name__, str(error), None if tr is None else tr.state.global_step)
    save(out, "refusals", seen)


def main(out: str, text: str, *tasks: str) -> None:
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    done, weights = None, {}  # the trained Trainer, exported by ``export`` and evaluated by ``eval``
    for task in tasks:
        if task == "train":
            done = trainer(root / "train", text)
            seen = trained(done)
            weights = seen["weights"]
            save(root, "train", seen)
        elif task == "export":
            export_task(root, done, weights)
        elif task == "eval":
            eval_task(root, done or trainer(root / "eval", text))
        elif task == "same_mesh":
            checkpoint = str(root / "train" / f"checkpoint-{SAVE_AT}")
            save(root, "same_mesh", trained(trainer(root / "same_mesh", text), checkpoint))
        elif task.startswith("from="):
            source, _, schedule = task.removeprefix("from=").partition("@")
            on = text if not schedule else f"{text.rsplit(',', 1)[0]},{schedule}"
            checkpoint = str(Path(source) / "train" / f"checkpoint-{SAVE_AT}")
            save(root, "from", trained(trainer(root / "from", on), checkpoint))
        elif task == "refusals":
            refusals_task(root, text)
        else:
            raise SystemExit(f"unknown task {task!r}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
