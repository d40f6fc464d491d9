"""The Trainer: transformers' Trainer and TrainingArguments on our engine, with its checkpoints, batch finder, exact evaluation and adapt()."""
