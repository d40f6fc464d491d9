"""Fine-tune a small classifier with a hand-written loop on trainer_ext.Accelerator (accelerate's API).

trainer-ext launch --num_processes 2 --cpu examples/nlp_classifier.py --epochs 1
python examples/nlp_classifier.py --mixed_precision bf16 --with_tracking

The model and its tokenizer are saved together in --output_dir: ``AutoModelForSequenceClassification`` and
``AutoTokenizer.from_pretrained`` read that folder back.
"""

from __future__ import annotations

import datasets
import torch
from _common import pad, parse_args, shared_tokenizer
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

from trainer_ext import Accelerator
from trainer_ext.job.builtin_data import SENTIMENT

LABELS = {"negative": 0, "positive": 1}
PROBES = ["i felt the music was really thrilling .", "the plot was so slow and dull ."]


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
    # the main process trains the tokenizer and fills the datasets cache; the others then reuse both
    with accelerator.main_process_first():
        raw = datasets.load_dataset("json", data_files=str(SENTIMENT))["train"].train_test_split(0.1, seed=0)
        if args.max_train_samples is not None:
            raw["train"] = raw["train"].select(range(args.max_train_samples))
        tokenizer = shared_tokenizer(accelerator, args.output_dir, raw["train"]["text"], "[CLS]", cls_token="[CLS]")

        def tokenize(batch: dict) -> dict:
            ids = tokenizer(batch["text"], truncation=True, max_length=63)["input_ids"]  # [CLS] text
            return {"input_ids": ids, "labels": [LABELS[label] for label in batch["label"]]}

        data = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        input_ids = pad([r["input_ids"] for r in rows], tokenizer.pad_token_id)
        return {
            "input_ids": input_ids,
            "attention_mask": (input_ids != tokenizer.pad_token_id).long(),
            "labels": torch.tensor([r["labels"] for r in rows]),
        }

    train_dl = torch.utils.data.DataLoader(data["train"], batch_size=args.batch_size, shuffle=True, collate_fn=collate)
    eval_dl = torch.utils.data.DataLoader(data["test"], batch_size=64, collate_fn=collate)
    torch.manual_seed(args.seed)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=2,
        id2label={i: name for name, i in LABELS.items()},
        label2id=LABELS,
    )
    model = BertForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # accelerate's convention: sized from the unsharded loader; a prepared scheduler advances once per process
    steps = args.epochs * -(-len(train_dl) // accelerator.gradient_accumulation_steps)
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

    accelerator.save_model(model, args.output_dir)  # next to the tokenizer saved by shared_tokenizer
    if accelerator.is_main_process:  # new sentences through the plain fp32 model, as from_pretrained will load it
        plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
        with torch.no_grad():
            probs = plain(**tokenizer(PROBES, padding=True, return_tensors="pt").to(accelerator.device)).logits
        for text, p in zip(PROBES, probs.softmax(-1).tolist(), strict=True):
            accelerator.print(f"predict: {text!r} -> p(positive)={p[1]:.6f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
