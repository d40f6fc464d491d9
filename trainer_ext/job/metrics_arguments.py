"""The evaluation-metric flags of ``trainer-ext train`` (``--metrics``, ``--metrics_average``) and their checks."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer_ext.errors import ConfigError, did_you_mean
from trainer_ext.job.fields import field_help
from trainer_ext.metrics.classification import AVERAGES
from trainer_ext.metrics.for_trainer import AVERAGED, parse_names
from trainer_ext.metrics.registry import CLASSIFICATION, TASK_METRICS, metric_class


@dataclass
class MetricsArguments:
    """Which metrics evaluation reports, computed offline by ``trainer_ext.metrics`` and streamed batch by batch."""

    metrics: None | str | list[str] = field(
        default=None,
        metadata=field_help(
            "Evaluation metrics, comma-separated (a YAML list in a config file). sequence-classification: "
            f"{', '.join(TASK_METRICS[CLASSIFICATION])}; causal-lm: perplexity, accuracy (next-token). Default: "
            "accuracy for sequence-classification; for causal-lm only eval_loss and eval_perplexity = exp(eval_loss), "
            "which needs no logits."
        ),
    )
    metrics_average: str | None = field(
        default=None,
        metadata=field_help(
            f"How {', '.join(AVERAGED)} average over classes: {', '.join(AVERAGES)} (binary: the class with id 1 "
            "only). Default: binary for 2 classes, macro for more."
        ),
    )

    def validate_metrics(self) -> None:
        """Check the names against the task (already normalised) and the average; raise ConfigError on bad input."""
        names = parse_names(self.metrics)
        if names is not None and not names:
            raise ConfigError(
                f"--metrics {self.metrics!r} names no metric; pass e.g. --metrics accuracy,f1, or leave it out"
            )
        if names and self.task == "dpo":
            raise ConfigError(
                "--metrics applies to sequence-classification, causal-lm and sft; a dpo job logs its rewards and "
                "accuracies itself: drop --metrics"
            )
        for name in names or []:
            metric_class(name, "causal-lm" if self.task == "sft" else self.task)
        self.metrics = names
        if self.metrics_average is None:
            return
        average = self.metrics_average.strip().lower()
        if average not in AVERAGES:
            raise ConfigError(
                f"--metrics_average {self.metrics_average!r}: choose one of {', '.join(AVERAGES)}."
                f"{did_you_mean(average, AVERAGES)}"
            )
        if not set(names or []) & set(AVERAGED) or self.task != CLASSIFICATION:
            raise ConfigError(
                f"--metrics_average applies to {', '.join(AVERAGED)} of a sequence-classification job; add one to "
                "--metrics (e.g. --metrics accuracy,f1) or drop --metrics_average"
            )
        self.metrics_average = average
