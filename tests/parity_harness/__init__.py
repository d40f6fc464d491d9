"""The one parity harness: stock (transformers + accelerate) against ours (trainer_ext) on the same scripts.

Two scenario sets use it: ``tests/parity`` (ordinary ``Trainer`` scripts) and ``tests/accelerator_parity``
(hand-written ``Accelerator`` loops, and accelerate's own example scripts). Each set holds its scenarios, what they
observe and its comparison rules (tolerances, deliberate differences); the harness holds what they share:
``workload`` (a scenario process's set-up: accelerate hidden from ours, quiet and deterministic, versions),
``runner`` (both implementations' batches side by side; ranks forked or started by torchrun), ``compare`` (the
report a comparison gives and its helpers) and ``registry`` (the implementations and the cases a pytest run selected).
"""
