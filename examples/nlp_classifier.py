"""Fine-tune a small classifier with a hand-written loop on trainer_ext.Accelerator (accelerate's API).

trainer-ext launch --num_processes 2 --cpu examples/nlp_classifier.py --epochs 1
python examples/nlp_classifier.py --mixed_precision bf16 --with_tracking
"""

from __future__ import annotations

import datasets
import torch
from _common import pad, parse_args, word_tokenizer
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

from trainer_ext import Accelerator
from trainer_ext.data import SENTIMENT

LABELS = {"negative": 0, "positive": 1}


def main() -> None:
    args = parse_args("sentiment classifier, hand-written loop", output_dir="outputs/nlp_classifier")
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        cpu=args.cpu,
        log_with="tensorboard" if args.with_tracking else None,
        project_dir=args.output_dir,
        seed=args.seed,
    )
    with accelerator.main_process_first():  # the main process fills the datasets cache, the others reuse it
        raw = datasets.load_dataset("json", data_files=str(SENTIMENT))["train"].train_test_split(0.1, seed=0)
    train_rows = raw["train"] if args.max_train_samples is None else raw["train"].select(range(args.max_train_samples))
    tokenizer = word_tokenizer(train_rows["text"], ["[PAD]", "[UNK]", "[CLS]"])
    cls = tokenizer.token_to_id("[CLS]")

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        ids = [[cls] + tokenizer.encode(r["text"]).ids[:62] for r in rows]
        input_ids = pad(ids, 0)
        return {
            "input_ids": input_ids,
            "attention_mask": (input_ids != 0).long(),
            "labels": torch.tensor([LABELS[r["label"]] for r in rows]),
        }

    train_dl = torch.utils.data.DataLoader(train_rows, batch_size=args.batch_size, shuffle=True, collate_fn=collate)
    eval_dl = torch.utils.data.DataLoader(raw["test"], batch_size=64, collate_fn=collate)
    torch.manual_seed(args.seed)
    config = BertConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    steps = args.epochs * -(-len(train_dl) // (accelerator.num_processes * accelerator.gradient_accumulation_steps))
    scheduler = get_linear_schedule_with_warmup(optimizer, steps // 10, steps)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler
    )
    accelerator.init_trackers("nlp_classifier", config=vars(args))

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
        correct = total = 0
        for batch in eval_dl:
            with torch.no_grad():
                predictions = model(**batch).logits.argmax(-1)
            predictions, labels = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += int((predictions == labels).sum())
            total += len(labels)
        accelerator.print(f"epoch {epoch}: eval_accuracy={correct / total:.4f} eval_samples={total}")
        accelerator.log({"eval_accuracy": correct / total, "train_loss": loss.item()}, step=epoch)

    accelerator.save_model(model, args.output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main()
