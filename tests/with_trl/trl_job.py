"""One TRL run on a tiny model built from a config and local data: TRL's stock trainer, or ``trainer_ext.adapt`` of it.

    python -m tests.with_trl.trl_job --trainer sft --impl ours --out DIR [--max_steps 6] [--resume]
    python -m torch.distributed.run --nproc_per_node 2 -m tests.with_trl.trl_job ...
    trainer-ext launch --cpu --num_processes 2 tests/with_trl/trl_job.py ...
    python -m tests.with_trl.trl_job --trainer sft --impl ours --lora --out DIR   (peft_config=LoraConfig(...))
    ... --cp_size 2 [--parallelism_config trainer_ext|dict|accelerate]   (SFTConfig(..., parallelism_config=...))

The script is what a user writes from TRL's quick starts; the one line that differs between ``stock`` and ``ours`` is
``Trainer = adapt(Trainer)``. Rank 0 writes ``DIR/result.json`` (per-step losses, learning rates, the engine's class)
and the final weights (``DIR/final/model.safetensors``). ``--cp_size`` passes ``parallelism_config`` as a TRL user does
(``trainer_ext.ParallelismConfig`` by default); the result then also records the attention the model ran and the
sequence length of each training forward on rank 0 (context parallelism splits it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

# Words of the toy corpus: word-level tokens keep every run the same with no hub download.
WORDS = (
    "the a cat dog sat ran on under mat rug big small red blue is was what where it and "
    "good bad yes no answer question user assistant system helpful reply".split()
)
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ 'assistant : ' }}"
    "{% generation %}{{ message['content'] + ' </s>' }}{% endgeneration %}"
    "{% else %}{{ message['role'] + ' : ' + message['content'] + ' ' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant : ' }}{% endif %}"
)
TRAINERS = ("sft", "sft_messages", "sft_packing", "dpo", "reward")


def tokenizer():  # noqa: ANN201  (transformers' fast tokenizer)
    """A word-level tokenizer over ``WORDS`` with a chat template that marks the assistant's tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(SPECIAL + WORDS + [":", "?", "."])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def sentence(rng: torch.Generator, n: int) -> str:
    return " ".join(WORDS[int(i)] for i in torch.randint(0, 20, (n,), generator=rng))


def dataset(kind: str, n: int = 48):  # noqa: ANN201  (datasets.Dataset)
    """Local rows in the shape each trainer's quick start uses."""
    from datasets import Dataset

    rng = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, 12, (1,), generator=rng))
        if kind in ("sft", "sft_packing"):
            rows.append({"text": sentence(rng, length)})
        elif kind == "sft_messages":
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": sentence(rng, length) + " ?"},
                        {"role": "assistant", "content": sentence(rng, 3 + length // 2)},
                    ]
                }
            )
        else:  # preference pairs: an explicit prompt for DPO, implicit (shared start) for the reward model
            prompt, chosen, rejected = sentence(rng, length), "yes good answer", sentence(rng, 3)
            if kind == "dpo":
                rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
            else:
                rows.append({"chosen": f"{prompt} {chosen}", "rejected": f"{prompt} {rejected}"})
    return Dataset.from_list(rows)


def model(kind: str, vocab_size: int, pad_id: int, seed: int = 0):  # noqa: ANN201
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=pad_id, bos_token_id=2, eos_token_id=3,
        num_labels=1,
    )  # fmt: skip
    return (LlamaForSequenceClassification if kind == "reward" else LlamaForCausalLM)(config)


def parallelism_config(cp_size: int, kind: str):  # noqa: ANN201
    """``ParallelismConfig(cp_size=...)`` as a script passes it: accelerate's class, trainer_ext's, or a plain dict."""
    if kind == "dict":
        return {"cp_size": cp_size}
    if kind == "accelerate":
        from accelerate import ParallelismConfig
    else:
        from trainer_ext import ParallelismConfig
    return ParallelismConfig(cp_size=cp_size)


def build(  # noqa: ANN201
    kind: str, impl: str, out: Path, max_steps: int, save_steps: int, batch: int, lora: bool = False,
    parallelism: object = None,
):  # fmt: skip
    """The trainer a TRL quick start builds, with ``adapt`` as the only change for ``ours``; ``lora``: TRL's PEFT
    quick start, ``peft_config=LoraConfig(...)`` (TRL wraps the model itself); ``parallelism``: the config's
    ``parallelism_config`` (left unset when None)."""
    import trl

    tok = tokenizer()
    common = dict(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1, save_steps=save_steps,
        report_to="none", seed=42, bf16=False, dataloader_drop_last=True,
    )  # fmt: skip
    if parallelism is not None:
        common["parallelism_config"] = parallelism
    if kind.startswith("sft"):
        Trainer, config = trl.SFTTrainer, trl.SFTConfig
        extra = dict(max_length=32, packing=kind == "sft_packing", assistant_only_loss=kind == "sft_messages")
    elif kind == "dpo":
        Trainer, config = trl.DPOTrainer, trl.DPOConfig
        extra = dict(max_length=32, beta=0.1)
    else:
        Trainer, config = trl.RewardTrainer, trl.RewardConfig
        extra = dict(max_length=32)
    if impl == "ours":
        from trainer_ext import adapt

        Trainer = adapt(Trainer)  # noqa: N806  (the one line a script changes)
    pad = tok.pad_token_id
    kwargs = dict(model=model(kind, len(tok), pad), args=config(**common, **extra), train_dataset=dataset(kind))
    if kind == "dpo":
        kwargs["ref_model"] = model(kind, len(tok), pad)  # the same weights, frozen
    if lora:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return Trainer(processing_class=tok, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer", choices=TRAINERS, required=True)
    parser.add_argument("--impl", choices=("stock", "ours"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--save_steps", type=int, default=3)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --out")
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft_config=LoraConfig(...))")
    parser.add_argument("--cp_size", type=int, default=None, help="parallelism_config=ParallelismConfig(cp_size=N)")
    parser.add_argument("--parallelism_config", choices=("trainer_ext", "dict", "accelerate"), default="trainer_ext")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import TrainerCallback

    trainer = build(
        options.trainer, options.impl, options.out, options.max_steps, options.save_steps,
        options.per_device_train_batch_size, options.lora,
        None if options.cp_size is None else parallelism_config(options.cp_size, options.parallelism_config),
    )  # fmt: skip
    lengths: list[int] = []  # the sequence length of each training forward on this rank

    def record(module: torch.nn.Module, args: tuple) -> None:
        if module.training:
            lengths.append(int(args[0].shape[-1]))

    trainer.model.get_input_embeddings().register_forward_pre_hook(record)
    trained: list[int] = []  # the optimizer steps this run took (a resumed run starts after its checkpoint)

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            trained.append(state.global_step)

    trainer.add_callback(Steps())
    trainer.train(resume_from_checkpoint=True if options.resume else None)
    trainer.save_model(str(options.out / "final"))
    if trainer.is_world_process_zero():
        history = trainer.state.log_history
        result = {
            "engine": f"{type(trainer.accelerator).__module__}.{type(trainer.accelerator).__name__}",
            "args_type": [c.__module__ + "." + c.__name__ for c in type(trainer.args).__mro__[:3]],
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "steps": {
                str(e["step"]): {"loss": e["loss"], "learning_rate": e["learning_rate"]}
                for e in history
                if "loss" in e
            },
            "final_step": trainer.state.global_step,
            "model_type": type(trainer.model).__name__,
            "trainable": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad),
            "trained_steps": trained,
            "files": sorted(str(f.relative_to(options.out)) for f in options.out.rglob("*") if f.is_file()),
            "metrics": {  # what TRL's trainers log beside the loss (token counts, entropy, accuracy, DPO's rewards)
                str(e["step"]): {k: v for k, v in e.items() if k not in ("loss", "learning_rate", "step", "epoch")}
                for e in history
                if "loss" in e
            },
            "attn_implementation": trainer.accelerator.unwrap_model(trainer.model).config._attn_implementation,
            "train_lengths": lengths,
        }
        (options.out / "result.json").write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
