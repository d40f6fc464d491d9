"""Helpers shared across the test folders: tiny models and data, Trainer arguments and jobs, hand-written loops,
and ``run_ranks`` (a job module on N gloo ranks under torchrun)."""
