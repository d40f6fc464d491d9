"""Train a small causal LM with gradient accumulation on trainer_ext.Accelerator (accelerate's API).

trainer-ext launch --num_processes 2 --cpu --gradient_accumulation_steps 2 examples/causal_lm.py
python examples/causal_lm.py --mixed_precision bf16 --with_tracking
"""

from __future__ import annotations

import math

import datasets
import torch
from _common import pad, parse_args, word_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

from trainer_ext import Accelerator
from trainer_ext.data import CORPUS


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
    with accelerator.main_process_first():
        raw = datasets.load_dataset("json", data_files=str(CORPUS))["train"].train_test_split(0.05, seed=0)
    train_rows = raw["train"] if args.max_train_samples is None else raw["train"].select(range(args.max_train_samples))
    tokenizer = word_tokenizer(train_rows["text"], ["[PAD]", "[UNK]", "[BOS]", "[EOS]"])
    bos, eos = tokenizer.token_to_id("[BOS]"), tokenizer.token_to_id("[EOS]")

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        ids = [[bos] + tokenizer.encode(r["text"]).ids[:62] + [eos] for r in rows]
        input_ids = pad(ids, 0)
        labels = input_ids.masked_fill(input_ids == 0, -100)
        return {"input_ids": input_ids, "attention_mask": (input_ids != 0).long(), "labels": labels}

    train_dl = torch.utils.data.DataLoader(train_rows, batch_size=args.batch_size, shuffle=True, collate_fn=collate)
    eval_dl = torch.utils.data.DataLoader(raw["test"], batch_size=32, collate_fn=collate)
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps = args.epochs * -(-len(train_dl) // (accelerator.num_processes * accelerator.gradient_accumulation_steps))
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

    accelerator.save_model(model, args.output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main()
