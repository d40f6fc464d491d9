"""Property-based fuzzing of metric inputs: ``metrics.load`` names and options, and the predictions and references
given to ``compute`` (huge and negative ids, NaN and infinities, strings, None, ragged lists, logits of odd shapes).

Every call ends with a result of floats or one ``ValueError`` line (``ConfigError`` is one), never another
exception, and the state is sized by the classes present: at most a few megabytes whatever the class ids.
Bounded for CI: ``EXAMPLES`` examples per property (``TRAINER_EXT_FUZZ_EXAMPLES`` overrides), no deadline.
"""

from __future__ import annotations

import math
import os
import tracemalloc

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis", reason="the dev extra installs hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from trainer_ext.errors import ConfigError  # noqa: E402
from trainer_ext.metrics import NAMES, load  # noqa: E402

EXAMPLES = int(os.environ.get("TRAINER_EXT_FUZZ_EXAMPLES", "60"))
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)
MEMORY = 16 << 20  # the most a compute of a few dozen values may hold at once

CLASSIFICATION = ["accuracy", "f1", "precision", "recall", "matthews_correlation"]
ids = st.one_of(
    st.integers(0, 3),
    st.integers(-3, 2**63 - 1),
    st.sampled_from([10**6, 10**12, 2**62, 2**63 - 1]),
)
scalars = st.one_of(
    ids,
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=4),
)
values = st.one_of(
    st.lists(ids, max_size=12),
    st.lists(scalars, max_size=6),
    st.lists(st.lists(scalars, max_size=3), max_size=4),
    scalars,
)
options = st.fixed_dictionaries(
    {},
    optional={
        "average": st.sampled_from(["binary", "macro", "micro", "weighted", "", "Macro", None, 3]),
        "pos_label": st.one_of(ids, st.text(max_size=3), st.none()),
        "labels": st.one_of(st.lists(ids, max_size=4), st.none(), st.text(max_size=3)),
        "normalize": st.one_of(st.booleans(), st.none()),
        "junk": st.integers(),
    },
)


def _bounded(call):
    """Run ``call`` and check it held at most MEMORY at once; returns its result or the ValueError it raised."""
    tracemalloc.start()
    try:
        try:
            result = call()
        except ValueError as error:
            result = error
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MEMORY, peak
    return result


def _check(result) -> None:
    if isinstance(result, ValueError):
        assert str(result) and "\n" not in str(result), repr(result)
        return
    assert isinstance(result, dict) and result
    assert all(isinstance(v, float) for v in result.values()), result


@SETTINGS
@given(
    name=st.sampled_from(CLASSIFICATION),
    options=options,
    batches=st.lists(st.tuples(values, values), min_size=1, max_size=3),
)
def test_classification_metrics_take_any_input(name, options, batches):
    def run():
        metric = load(name, **options)
        for predictions, references in batches[:-1]:
            metric.add_batch(predictions=predictions, references=references)
        predictions, references = batches[-1]
        return metric.compute(predictions=predictions, references=references)

    _check(_bounded(run))


@SETTINGS
@given(
    references=st.lists(ids, min_size=1, max_size=12),
    seed=st.integers(0, 2**16),
    name=st.sampled_from(CLASSIFICATION),
    average=st.sampled_from(["macro", "micro", "weighted"]),
)
def test_class_ids_are_only_names(references, seed, name, average):
    """Renaming the classes to 0, 1, 2, … changes no score, and huge ids cost no memory."""
    rng = np.random.default_rng(seed)
    references = np.array(references, dtype=np.int64)
    references = np.where(references < 0, 0, references)
    predictions = np.where(rng.random(len(references)) < 0.5, references, rng.choice(references, len(references)))
    _, compact = np.unique(np.concatenate([references, predictions]), return_inverse=True)
    small_refs, small_preds = compact[: len(references)], compact[len(references) :]
    kwargs = {"average": average} if name in ("f1", "precision", "recall") else {}
    big = _bounded(lambda: load(name, **kwargs).compute(predictions=predictions, references=references))
    small = load(name, **kwargs).compute(predictions=small_preds, references=small_refs)
    assert big.keys() == small.keys()
    for key in big:
        assert (math.isnan(big[key]) and math.isnan(small[key])) or big[key] == pytest.approx(small[key])


@SETTINGS
@given(name=st.one_of(st.text(max_size=20), st.integers(), st.none(), st.sampled_from([*NAMES, "", ".", "/", "~"])))
def test_load_takes_any_name(name):
    """Any name is one of ours, or one ConfigError; the tests never have evaluate modules, so nothing else."""
    try:
        load(name)
    except ConfigError as error:
        assert "\n" not in str(error)
    else:
        assert name.strip().lower().replace("-", "_") in NAMES


@SETTINGS
@given(
    name=st.sampled_from(["perplexity", "token_accuracy"]),
    shape=st.lists(st.integers(0, 4), min_size=1, max_size=3),
    vocabulary=st.integers(0, 5),
    low=st.integers(-200, 6),
    logits=st.booleans(),
    special=st.sampled_from([None, float("nan"), float("inf")]),
)
def test_language_model_metrics_take_any_shape(name, shape, vocabulary, low, logits, special):
    gen = torch.Generator().manual_seed(len(shape) * 31 + vocabulary)
    labels = torch.randint(low, low + 8, tuple(shape), generator=gen)
    predictions = (
        torch.randn(*shape, vocabulary, generator=gen) if logits else torch.randint(0, 5, tuple(shape), generator=gen)
    )
    if special is not None and logits and predictions.numel():
        predictions.view(-1)[0] = special
    result = _bounded(lambda: load(name).compute(predictions=predictions, references=labels))
    _check(result)
