"""``trainer_ext.metrics``: each metric against hand-computed values (and scikit-learn where it is installed),
streaming equal to one-shot, the causal shift and -100 labels, errors, and no network for our names."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer_ext import metrics
from trainer_ext.errors import ConfigError
from trainer_ext.metrics import NAMES, TrainerMetrics, build_metrics, load

# refs [0,0,0,1,1,2], preds [0,0,1,1,2,2]: per class (P, R, F1) = (1, 2/3, 4/5), (1/2, 1/2, 1/2), (1/2, 1, 2/3);
# supports 3, 2, 1; micro: tp 4, fp 2, fn 2; MCC: t=[3,2,1], p=[2,2,2] → (4·6 − 12) / sqrt((36 − 12)(36 − 14))
REFS, PREDS = [0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 2, 2]
HAND = {
    ("precision", "macro"): (1 + 0.5 + 0.5) / 3,
    ("precision", "weighted"): (3 * 1 + 2 * 0.5 + 1 * 0.5) / 6,
    ("precision", "micro"): 4 / 6,
    ("recall", "macro"): (2 / 3 + 0.5 + 1) / 3,
    ("recall", "weighted"): 4 / 6,
    ("recall", "micro"): 4 / 6,
    ("f1", "macro"): (0.8 + 0.5 + 2 / 3) / 3,
    ("f1", "weighted"): (3 * 0.8 + 2 * 0.5 + 1 * 2 / 3) / 6,
    ("f1", "micro"): 4 / 6,
}


@pytest.mark.parametrize(("name", "average"), sorted(HAND))
def test_averaged_metrics_by_hand(name, average):
    assert load(name, average=average).compute(predictions=PREDS, references=REFS) == {
        name: pytest.approx(HAND[name, average])
    }


def test_the_documented_examples_of_scikit_learn_and_evaluate():
    refs, preds = [0, 1, 2, 0, 1, 2], [0, 2, 1, 0, 0, 1]  # scikit-learn's f1/precision/recall docstrings
    assert load("f1", average="macro").compute(predictions=preds, references=refs)["f1"] == pytest.approx(0.26666666)
    assert load("f1", average="micro").compute(predictions=preds, references=refs)["f1"] == pytest.approx(1 / 3)
    assert load("precision", average="macro").compute(predictions=preds, references=refs)["precision"] == (
        pytest.approx(0.22222222)
    )
    assert load("recall", average="weighted").compute(predictions=preds, references=refs)["recall"] == (
        pytest.approx(1 / 3)
    )
    # evaluate's f1 and accuracy cards; matthews_corrcoef's docstring with -1 → 0
    assert load("f1").compute(predictions=[0, 0, 1, 1, 0], references=[0, 1, 0, 1, 0]) == {"f1": 0.5}
    assert load("accuracy").compute(predictions=[0, 1, 1, 2, 1, 0], references=[0, 1, 2, 0, 1, 2]) == {"accuracy": 0.5}
    result = load("matthews_correlation").compute(predictions=[1, 0, 1, 1], references=[1, 1, 1, 0])
    assert result == {"matthews_correlation": pytest.approx(-1 / 3)}


def test_binary_scores_the_positive_class():
    # tp 1 (index 1), fp 1 (index 2), fn 2 (indices 3, 4)
    refs, preds = [0, 1, 0, 1, 1], [0, 1, 1, 0, 0]
    assert load("precision").compute(predictions=preds, references=refs) == {"precision": 0.5}
    assert load("recall").compute(predictions=preds, references=refs) == {"recall": pytest.approx(1 / 3)}
    assert load("f1").compute(predictions=preds, references=refs) == {"f1": pytest.approx(2 / 5)}
    # class 0: tp 1 (index 0), fp 2 (indices 3, 4), fn 1 (index 2)
    assert load("f1", pos_label=0).compute(predictions=preds, references=refs) == {"f1": pytest.approx(2 / 5)}


def test_matthews_correlation_multi_class_and_degenerate():
    result = load("matthews_correlation").compute(predictions=PREDS, references=REFS)
    assert result["matthews_correlation"] == pytest.approx((4 * 6 - 12) / math.sqrt((36 - 12) * (36 - 14)))
    assert load("matthews_correlation").compute(predictions=[1, 1], references=[0, 1]) == {"matthews_correlation": 0.0}
    perfect = load("matthews_correlation").compute(predictions=[2, 0, 1], references=[2, 0, 1])
    assert perfect == {"matthews_correlation": pytest.approx(1.0)}


def test_accuracy_takes_logits_tensors_and_counts():
    logits = torch.tensor([[2.0, 1.0], [0.0, 3.0], [1.0, 0.5]], dtype=torch.bfloat16)
    assert load("accuracy").compute(predictions=logits, references=torch.tensor([0, 1, 1])) == {
        "accuracy": pytest.approx(2 / 3)
    }
    assert load("accuracy", normalize=False).compute(predictions=[1, 1, 0], references=[1, 0, 0]) == {"accuracy": 2.0}


def test_zero_division_counts_as_zero_and_empty_is_nan():
    assert load("precision").compute(predictions=[0, 0], references=[1, 0]) == {"precision": 0.0}
    assert math.isnan(load("accuracy").compute()["accuracy"])


def _random_classification(seed: int, n: int = 500, classes: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    refs = rng.integers(0, classes, n)
    preds = np.where(rng.random(n) < 0.6, refs, rng.integers(0, classes, n))
    return preds, refs


@pytest.mark.parametrize("average", ["macro", "micro", "weighted"])
@pytest.mark.parametrize("name", ["accuracy", "f1", "precision", "recall", "matthews_correlation"])
def test_streaming_in_uneven_batches_equals_one_shot(name, average):
    preds, refs = _random_classification(0)
    options = {"average": average} if name in ("f1", "precision", "recall") else {}
    one_shot = load(name, **options).compute(predictions=preds, references=refs)
    metric = load(name, **options)
    cuts = [0, 1, 7, 100, 101, 333, 500]
    for start, stop in zip(cuts, cuts[1:], strict=False):
        metric.add_batch(predictions=preds[start:stop], references=refs[start:stop])
    assert len(metric.counts) <= 4 * 4  # one count per (true, predicted) pair of 4 classes, not 500 predictions
    assert metric.compute() == pytest.approx(one_shot)
    assert metric.counts.size == 0  # compute resets


def test_a_class_seen_only_in_later_batches_grows_the_counts():
    metric = load("f1", average="macro")
    metric.add_batch(predictions=[0, 0, 1], references=[0, 1, 1])
    metric.add_batch(predictions=[2, 2, 1], references=[2, 0, 1])
    assert metric.compute() == pytest.approx(
        load("f1", average="macro").compute(predictions=[0, 0, 1, 2, 2, 1], references=[0, 1, 1, 2, 0, 1])
    )


@pytest.mark.parametrize("seed", [1, 2])
def test_against_scikit_learn_where_installed(seed):
    """scikit-learn is not a dependency: compared only where it is installed."""
    skm = pytest.importorskip("sklearn.metrics")
    preds, refs = _random_classification(seed, classes=5)
    assert load("accuracy").compute(predictions=preds, references=refs)["accuracy"] == pytest.approx(
        skm.accuracy_score(refs, preds)
    )
    mcc = load("matthews_correlation").compute(predictions=preds, references=refs)["matthews_correlation"]
    assert mcc == pytest.approx(skm.matthews_corrcoef(refs, preds))
    for name, fn in (("f1", skm.f1_score), ("precision", skm.precision_score), ("recall", skm.recall_score)):
        for average in ("macro", "micro", "weighted"):
            ours = load(name, average=average).compute(predictions=preds, references=refs)[name]
            assert ours == pytest.approx(fn(refs, preds, average=average, zero_division=0))
        binary = (preds > 2).astype(int), (refs > 2).astype(int)
        assert load(name).compute(predictions=binary[0], references=binary[1])[name] == pytest.approx(
            fn(binary[1], binary[0])
        )


def test_classification_errors():
    with pytest.raises(ValueError, match="average='binary'.*macro"):
        load("f1").compute(predictions=PREDS, references=REFS)
    with pytest.raises(ValueError, match="6 predictions but 5 references"):
        load("accuracy").compute(predictions=PREDS, references=REFS[:5])
    with pytest.raises(ValueError, match="class ids"):
        load("accuracy").compute(predictions=[0.5, 1.0], references=[0, 1])
    with pytest.raises(ValueError, match="pass both"):
        load("accuracy").compute(predictions=[1])


# causal LM: logits at t predict the label at t + 1; -100 labels count for nothing


def _lm_batch(seed: int, batch: int = 3, length: int = 6, vocab: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, vocab, generator=gen)
    labels = torch.randint(0, vocab, (batch, length), generator=gen)
    labels[0, :2] = -100  # a prompt
    labels[-1, -3:] = -100  # padding
    return logits, labels


def test_perplexity_by_hand_with_the_shift_and_ignored_labels():
    # vocabulary of 2; logits 0, 2 and 3 are sure of token 0, logits 1 uniform (the last ones face no label)
    logits = torch.tensor([[[9.0, -9.0], [0.0, 0.0], [9.0, -9.0], [9.0, -9.0]]])
    labels = torch.tensor([[-100, 0, 1, 1]])  # labels 1, 2, 3 face logits 0 (right), 1 (uniform), 2 (sure, wrong)
    nll = [math.log1p(math.exp(-18.0)), math.log(2.0), math.log1p(math.exp(18.0))]
    result = load("perplexity").compute(predictions=logits, references=labels)
    assert result == {"perplexity": pytest.approx(math.exp(sum(nll) / 3))}
    assert load("accuracy", task="causal-lm").compute(predictions=logits, references=labels) == {
        "accuracy": pytest.approx(1 / 3)  # right at 0, a tie (argmax 0, label 1) at 1, wrong at 2
    }
    unshifted = load("perplexity", shift=False).compute(predictions=logits, references=labels)
    assert unshifted == {"perplexity": pytest.approx(math.exp((nll[1] + 2 * nll[2]) / 3))}


def test_perplexity_is_exp_of_transformers_causal_lm_loss():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=13, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 13, (2, 7))
    labels = ids.clone()
    labels[0, :3] = -100
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    result = load("perplexity").compute(predictions=out.logits, references=labels)
    assert result["perplexity"] == pytest.approx(math.exp(out.loss.item()), rel=1e-5)


@pytest.mark.parametrize("name", ["perplexity", "token_accuracy"])
def test_lm_streaming_equals_one_shot_per_token(name):
    batches = [_lm_batch(seed, batch=b, length=n) for seed, (b, n) in enumerate([(3, 6), (1, 9), (4, 2)])]
    metric = load(name)
    for logits, labels in batches:
        metric.add_batch(predictions=logits, references=labels)
    streamed = metric.compute()
    # one shot, per token: the shifted pairs of every batch pooled into one flat list
    pairs = [(lg[:, :-1].reshape(-1, 11), lb[:, 1:].reshape(-1)) for lg, lb in batches]
    logits, labels = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    keep = labels != -100
    if name == "perplexity":
        expected = math.exp(torch.nn.functional.cross_entropy(logits[keep], labels[keep]).item())
        assert streamed == {"perplexity": pytest.approx(expected, rel=1e-6)}
    else:
        expected = (logits[keep].argmax(-1) == labels[keep]).float().mean().item()
        assert streamed == {"accuracy": pytest.approx(expected)}
    assert metric.tokens == 0  # reset: the state is two numbers


def test_token_accuracy_takes_predicted_ids_and_numpy():
    labels = np.array([[5, 1, 2, -100]])
    preds = np.array([[1, 2, 0, 7]])  # shifted: (1→1 right), (2→2 right), (0→-100 ignored)
    assert load("token_accuracy").compute(predictions=preds, references=labels) == {"accuracy": 1.0}


def test_lm_errors():
    with pytest.raises(ValueError, match="needs logits"):
        load("perplexity").compute(predictions=[[1, 2]], references=[[1, 2]])
    with pytest.raises(ValueError, match="do not match"):
        load("perplexity").compute(predictions=torch.zeros(1, 3, 4), references=torch.zeros(1, 4, dtype=torch.long))
    assert math.isnan(load("perplexity").compute()["perplexity"])


# names, options, errors, no network


def test_load_knows_our_names_and_the_task_decides_what_accuracy_means():
    assert NAMES == ("accuracy", "f1", "matthews_correlation", "perplexity", "precision", "recall", "token_accuracy")
    assert type(load("accuracy")).__name__ == "Accuracy"
    assert type(load("Matthews-Correlation")).__name__ == "MatthewsCorrelation"
    assert type(load("accuracy", task="causal-lm")).__name__ == "TokenAccuracy"
    assert type(load("token_accuracy", task="causal-lm")).__name__ == "TokenAccuracy"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: load("acuracy"), "unknown metric 'acuracy'; known metrics: accuracy, f1.*Did you mean 'accuracy'"),
        (lambda: load("perplexity", task="sequence-classification"), "does not fit --task sequence-classification"),
        (lambda: load("f1", task="causal-lm"), "metrics for causal-lm: perplexity, accuracy"),
        (lambda: load("accuracy", average="macro"), "takes no option average; its options: normalize"),
        (lambda: load("f1", average="macr"), "average must be one of binary, macro, micro, weighted"),
        (lambda: load("bleu"), "unknown metric 'bleu'"),
    ],
)
def test_load_errors_are_config_errors(call, message):
    with pytest.raises(ConfigError, match=message):
        call()


def test_our_names_never_touch_the_network_nor_evaluate(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network call")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    try:
        import evaluate

        monkeypatch.setattr(evaluate, "load", refuse)
    except ImportError:
        pass
    for name in NAMES:
        metric = load(name)
        if name in ("perplexity", "token_accuracy"):
            metric.compute(predictions=torch.zeros(1, 3, 4), references=torch.ones(1, 3, dtype=torch.long))
        else:
            metric.compute(predictions=[0, 1], references=[0, 1])


def test_importing_the_metrics_loads_neither_evaluate_nor_the_trainer():
    code = (
        "import json, sys; from trainer_ext import metrics; [metrics.load(n) for n in metrics.NAMES]; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    modules = set(json.loads(out.stdout.splitlines()[-1]))
    assert "evaluate" not in modules and "transformers" not in modules and "torch" not in modules
    assert metrics.load is load and "trainer_ext.metrics" in sys.modules


def test_metrics_import_only_errors_of_ours():
    root = Path(metrics.__file__).parent
    for path in root.glob("*.py"):
        for line in path.read_text().splitlines():
            if line.startswith(("from trainer_ext", "import trainer_ext")) and not line.startswith(
                "from trainer_ext.metrics"
            ):
                assert line.startswith("from trainer_ext.errors import"), f"{path.name}: {line}"


EXACT = """
import datasets
import evaluate


class Exact(evaluate.Metric):
    def _info(self):
        features = datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")})
        return evaluate.MetricInfo(description="", citation="", inputs_description="", features=features)

    def _compute(self, predictions, references):
        return {"exact": sum(p == r for p, r in zip(predictions, references)) / len(predictions)}
"""
DELEGATE = """
import socket, sys
def refuse(*a, **k):
    raise AssertionError("network call")
socket.socket.connect = refuse
socket.create_connection = refuse
from trainer_ext.metrics import load
print(load(sys.argv[1]).compute(predictions=[1, 2], references=[1, 3])["exact"])
print(load("exact").compute(predictions=[1, 2], references=[1, 1])["exact"])
"""


@pytest.mark.timeout(120)
def test_a_local_evaluate_module_is_used_offline(tmp_path):
    pytest.importorskip("evaluate")
    script = tmp_path / "exact" / "exact.py"
    script.parent.mkdir()
    script.write_text(EXACT)
    cached = tmp_path / "modules" / "evaluate_modules" / "metrics" / "evaluate-metric--exact" / "0abc"
    cached.mkdir(parents=True)
    (cached / "exact.py").write_text(EXACT)
    env = {
        **__import__("os").environ,
        "HF_HOME": str(tmp_path / "home"),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "HF_EVALUATE_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", DELEGATE, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["0.5", "0.5"]


# the Trainer's compute_metrics: the batch protocol and the classic call agree


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


@pytest.mark.timeout(120)
def test_trainer_metrics_stream_under_batch_eval_metrics_and_match_the_classic_path(tmp_path):
    from trainer_ext import Trainer, TrainingArguments

    torch.manual_seed(1)
    xs, ys = torch.randn(23, 4), torch.randint(0, 3, (23,))
    rows = [{"x": x, "labels": int(y)} for x, y in zip(xs, ys, strict=True)]
    model = _Tiny()
    with torch.no_grad():
        preds = model.linear(xs).argmax(-1)
    expected = {}
    for name in ("accuracy", "f1", "matthews_correlation"):
        options = {"average": "macro"} if name == "f1" else {}
        expected.update(load(name, **options).compute(predictions=preds, references=ys))
    for batched in (True, False):
        args = TrainingArguments(
            output_dir=str(tmp_path / str(batched)),
            per_device_eval_batch_size=5,
            batch_eval_metrics=batched,
            report_to="none",
        )
        compute = TrainerMetrics(
            build_metrics("sequence-classification", ["accuracy", "f1", "matthews_correlation"], 3)
        )
        trainer = Trainer(model=model, args=args, eval_dataset=rows, compute_metrics=compute)
        result = trainer.evaluate()
        assert {k: result[f"eval_{k}"] for k in expected} == pytest.approx(expected)


def _lm_reference() -> dict[str, float]:
    """Perplexity and next-token accuracy of the job's model, one unpadded sequence at a time."""
    from tests.helpers.tiny import ragged_lm_dataset, tiny_llama

    model = tiny_llama(1).eval()
    perplexity, accuracy = load("perplexity"), load("token_accuracy")
    with torch.no_grad():
        for row in ragged_lm_dataset(11, seed=3)["input_ids"]:
            ids = torch.tensor([row])
            logits = model(input_ids=ids).logits
            perplexity.add_batch(predictions=logits, references=ids)
            accuracy.add_batch(predictions=logits, references=ids)
    return {"eval_perplexity": perplexity.compute()["perplexity"], "eval_accuracy": accuracy.compute()["accuracy"]}


@pytest.mark.timeout(120)
def test_lm_metrics_under_the_trainer_equal_one_sequence_at_a_time(tmp_path):
    from tests.helpers.metrics_job import lm_metrics_job

    expected = _lm_reference()
    for batched in (True, False):
        result = lm_metrics_job(tmp_path / str(batched), batch_eval_metrics=batched)
        assert {k: result[k] for k in expected} == pytest.approx(expected, rel=1e-5)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_lm_metrics_on_two_ranks_count_every_token_once(tmp_path):
    from tests.helpers.ranks import run_ranks

    run_ranks("tests.helpers.metrics_job", 2, str(tmp_path))
    result = json.loads((tmp_path / "results.json").read_text())
    expected = _lm_reference()
    assert {k: result[k] for k in expected} == pytest.approx(expected, rel=1e-5)
