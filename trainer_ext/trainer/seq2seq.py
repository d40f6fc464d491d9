"""``Seq2SeqTrainer`` and ``Seq2SeqTrainingArguments`` on our engine, for scripts written against transformers'.

transformers' own ``Seq2SeqTrainingArguments`` needs accelerate to be built; these are its re-based class and
``adapt(transformers.Seq2SeqTrainer)``: the same fields, defaults and generation behaviour, on our device set-up.
"""

from __future__ import annotations

import transformers

from trainer_ext.trainer.adapt import adapt, rebased_arguments_class

Seq2SeqTrainingArguments: type = rebased_arguments_class(transformers.Seq2SeqTrainingArguments)
Seq2SeqTrainer: type = adapt(transformers.Seq2SeqTrainer)

__all__ = ["Seq2SeqTrainer", "Seq2SeqTrainingArguments"]
