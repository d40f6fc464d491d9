"""``trainer-ext train --metrics …``: the flags and config keys, the eval results they add, and exit code 2 for a
metric that is unknown or does not fit the task."""

from __future__ import annotations

import json
import math

import pytest

from trainer_ext.cli.main import main
from trainer_ext.job.flags import parse_train_args

TINY = ["--max_steps", "3", "--max_train_samples", "128", "--max_eval_samples", "40", "--report_to", "none"]
TINY += ["--disable_tqdm", "true", "--per_device_eval_batch_size", "16"]  # 40 rows: batches of 16, 16, 8


def test_flags_and_config_files_mean_the_same(tmp_path):
    flags = parse_train_args(["--metrics", "accuracy, F1", "--metrics_average", "Macro"])
    assert (flags.metrics, flags.metrics_average) == (["accuracy", "f1"], "macro")
    for text in (
        "metrics: [accuracy, f1]\nmetrics_average: macro\n",
        "metrics: accuracy,f1\nmetrics-average: macro\n",
    ):
        config = tmp_path / "c.yaml"
        config.write_text(text)
        args = parse_train_args(["--config", str(config)])
        assert (args.metrics, args.metrics_average) == (["accuracy", "f1"], "macro")
    default = parse_train_args([])
    assert (default.metrics, default.metrics_average) == (None, None)


def _eval_results(capsys, out, *flags):
    code = main(["train", "--output_dir", str(out), *TINY, *flags])
    assert code == 0, capsys.readouterr().err[-3000:]
    return json.loads((out / "eval_results.json").read_text())


@pytest.mark.timeout(180)
def test_classification_metrics_in_the_eval_results(capsys, tmp_path):
    chosen = _eval_results(capsys, tmp_path / "chosen", "--metrics", "accuracy,f1,matthews_correlation")
    default = _eval_results(capsys, tmp_path / "default")
    assert {"eval_accuracy", "eval_f1", "eval_matthews_correlation", "eval_baseline_accuracy"} <= chosen.keys()
    assert "eval_f1" not in default and "eval_baseline_accuracy" in default
    assert chosen["eval_accuracy"] == default["eval_accuracy"]  # the same job: the default's accuracy, streamed
    assert 0 <= chosen["eval_f1"] <= 1 and -1 <= chosen["eval_matthews_correlation"] <= 1


@pytest.mark.timeout(180)
def test_causal_lm_perplexity_and_token_accuracy(capsys, tmp_path):
    flags = ["--task", "causal-lm", "--max_seq_length", "64", "--max_eval_samples", "60", "--max_train_samples", "300"]
    results = _eval_results(capsys, tmp_path / "clm", *flags, "--metrics", "perplexity,accuracy")
    assert {"eval_perplexity", "eval_accuracy", "eval_loss"} <= results.keys()
    assert 0 <= results["eval_accuracy"] <= 1
    # per token, not per batch: close to exp(eval_loss) when the blocks are (nearly) all full
    assert results["eval_perplexity"] == pytest.approx(math.exp(results["eval_loss"]), rel=0.05)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--metrics", "perplexity"], "metric 'perplexity' does not fit --task sequence-classification"),
        (["--metrics", "accuracy,acuracy"], "unknown metric 'acuracy'; metrics for sequence-classification"),
        (["--task", "causal-lm", "--metrics", "f1"], "metrics for causal-lm: perplexity, accuracy"),
        (["--metrics", " , "], "names no metric"),
        (["--metrics_average", "macro"], "--metrics_average applies to f1, precision, recall"),
        (["--metrics", "f1", "--metrics_average", "macr"], "Did you mean 'macro'"),
    ],
)
def test_bad_metrics_exit_2_with_one_line_and_write_nothing(capsys, tmp_path, flags, message):
    out = tmp_path / "out"
    code = main(["train", "--output_dir", str(out), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_binary_average_on_three_classes_exits_2_before_writing(capsys, tmp_path):
    rows = [{"text": f"review {i} {'bad ok great'.split()[i % 3]}", "label": i % 3} for i in range(30)]
    data = tmp_path / "three.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    flags = ["--train_file", str(data), "--metrics", "f1", "--metrics_average", "binary"]
    code = main(["train", "--output_dir", str(out), *flags])
    err = capsys.readouterr().err
    assert code == 2 and "the data has 3 classes; pass --metrics_average macro" in err
    assert not out.exists()


def test_help_lists_the_metric_flags(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--metrics" in out and "--metrics_average" in out and "matthews_correlation" in out
