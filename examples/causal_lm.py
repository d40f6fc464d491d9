"""Train a small causal LM with gradient accumulation on trainer_ext.Accelerator (accelerate's API).

trainer-ext launch --num_processes 2 --cpu --gradient_accumulation_steps 2 examples/causal_lm.py
python examples/causal_lm.py --mixed_precision bf16 --with_tracking

The model and its tokenizer are saved together in --output_dir: ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` read that folder back.
"""

from __future__ import annotations

import math

import datasets
import torch
from _common import pad, parse_args, shared_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

from trainer_ext import Accelerator
from trainer_ext.job.builtin_data import CORPUS

PROMPT = "hugo has two pears ."


def main() -> None:
    args = parse_args("tiny causal LM, hand-written loop", output_dir="outputs/causal_lm", lr=3e-3, epochs=3)
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        cpu=args.cpu,
        log_with="tensorboard" if args.with_tracking else None,
        project_dir=args.output_dir,
        seed=args.seed,
    )
    # the main process trains the tokenizer and fills the datasets cache; the others then reuse both
    with accelerator.main_process_first():
        raw = datasets.load_dataset("json", data_files=str(CORPUS))["train"].train_test_split(0.05, seed=0)
        if args.max_train_samples is not None:
            raw["train"] = raw["train"].select(range(args.max_train_samples))
        tokenizer = shared_tokenizer(
            accelerator, args.output_dir, raw["train"]["text"], "[BOS]", bos_token="[BOS]", eos_token="[EOS]"
        )

        def tokenize(batch: dict) -> dict:
            ids = tokenizer(batch["text"], truncation=True, max_length=63)["input_ids"]  # [BOS] text
            return {"input_ids": [row + [tokenizer.eos_token_id] for row in ids]}

        data = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        input_ids = pad([r["input_ids"] for r in rows], tokenizer.pad_token_id)
        labels = input_ids.masked_fill(input_ids == tokenizer.pad_token_id, -100)
        return {"input_ids": input_ids, "attention_mask": (labels != -100).long(), "labels": labels}

    train_dl = torch.utils.data.DataLoader(data["train"], batch_size=args.batch_size, shuffle=True, collate_fn=collate)
    eval_dl = torch.utils.data.DataLoader(data["test"], batch_size=32, collate_fn=collate)
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # accelerate's convention: sized from the unsharded loader; a prepared scheduler advances once per process
    steps = args.epochs * -(-len(train_dl) // accelerator.gradient_accumulation_steps)
    scheduler = get_cosine_schedule_with_warmup(optimizer, steps // 10, steps)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler
    )
    accelerator.init_trackers("causal_lm", config=vars(args))

    for epoch in range(args.epochs):
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        model.eval()
        losses = []
        for batch in eval_dl:
            with torch.no_grad():
                loss = model(**batch).loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(len(batch["input_ids"]))))
        perplexity = math.exp(torch.cat(losses).mean().item())
        accelerator.print(f"epoch {epoch}: eval_perplexity={perplexity:.2f} (uniform guess: {config.vocab_size})")
        accelerator.log({"eval_perplexity": perplexity}, step=epoch)

    accelerator.save_model(model, args.output_dir)  # next to the tokenizer saved by shared_tokenizer
    if accelerator.is_main_process:  # a greedy sample from the plain fp32 model, as from_pretrained will load it
        plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
        prompt = tokenizer(PROMPT, return_tensors="pt").to(accelerator.device)
        with torch.no_grad():
            out = plain.generate(**prompt, max_new_tokens=8, do_sample=False)
        continuation = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
        accelerator.print(f"sample: {PROMPT!r} -> {continuation!r}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
