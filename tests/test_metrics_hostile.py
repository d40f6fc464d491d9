"""``trainer_ext.metrics`` under hostile input: names that are not ours never reach ``evaluate`` (so no network
look-up) unless they are a local script, a non-string name is one ConfigError, and the classification counts are
sized by the classes present, never by the largest class id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch

from trainer_ext.errors import ConfigError
from trainer_ext.metrics import load

# loads each name given in a fresh process where any connection is an error, and says what happened to each
REFUSE = """
import json, socket, sys
def refuse(*a, **k):
    raise AssertionError("network call")
socket.socket.connect = refuse
socket.create_connection = refuse
socket.getaddrinfo = refuse
from trainer_ext.errors import ConfigError
from trainer_ext.metrics import load
said = {}
for name in json.loads(sys.argv[1]):
    try:
        load(name)
        said[name] = "loaded"
    except ConfigError as error:
        said[name] = "ConfigError: " + str(error)
    except BaseException as error:
        said[name] = type(error).__name__ + ": " + str(error)
print(json.dumps({"said": said, "evaluate": "evaluate" in sys.modules}))
"""


@pytest.mark.timeout(120)
def test_names_that_are_not_ours_nor_a_script_never_reach_evaluate(tmp_path):
    plain = tmp_path / "passwd"
    plain.write_text("root:x:0:0\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "other.py").write_text("")
    os.mkfifo(tmp_path / "fifo.py")  # a script name that is a FIFO: never opened
    os.mkfifo(tmp_path / "pipe")
    names = [
        "",
        "   ",
        ".",
        "..",
        "../../etc/passwd",
        str(plain),
        "/tmp",
        str(tmp_path / "folder"),
        str(tmp_path / "fifo.py"),
        str(tmp_path / "pipe"),
        "x" * 5000,
        "a\x00b",
    ]
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_MODULES_CACHE": str(tmp_path / "modules")}
    proc = subprocess.run(
        [sys.executable, "-c", REFUSE, json.dumps(names)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    for name, said in result["said"].items():
        assert said.startswith("ConfigError: "), (name, said)
        assert "\n" not in said
    assert result["evaluate"] is False  # evaluate was never imported, so it looked nothing up
    said = result["said"]
    assert "/tmp is a folder without tmp.py in it" in said["/tmp"]
    assert f"{plain} is not a .py script" in said[str(plain)]
    assert "fifo.py is not a regular file" in said[str(tmp_path / "fifo.py")]


@pytest.mark.parametrize("name", [123, None, 1.5, ["accuracy"], b"accuracy"])
def test_a_name_that_is_not_a_string_is_one_config_error(name):
    with pytest.raises(ConfigError, match="a metric name must be a string such as 'accuracy'"):
        load(name)


def test_a_task_that_is_not_a_string_is_one_config_error():
    with pytest.raises(ConfigError, match="task must be one of"):
        load("accuracy", task=["causal-lm"])


# classification counts: sized by the classes present


def _peak_bytes(call) -> tuple[object, int]:
    """``call()``'s result and the most memory it held at once (numpy's arrays are traced too)."""
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


REFS, PREDS = [0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 2, 2]
OPTIONS = [
    ("accuracy", {}),
    ("accuracy", {"normalize": False}),
    ("matthews_correlation", {}),
    *(
        (name, {"average": average})
        for name in ("f1", "precision", "recall")
        for average in ("macro", "micro", "weighted")
    ),
]


@pytest.mark.parametrize("big", [10**6, 10**12, 2**62 - 1])
@pytest.mark.parametrize(("name", "options"), OPTIONS)
def test_a_huge_class_id_costs_no_memory_and_scores_like_a_small_one(name, options, big):
    """Class 2 renamed ``big``: the same scores (each metric is blind to class names), in under a megabyte."""
    rename = {0: 0, 1: 1, 2: big}
    refs, preds = [rename[r] for r in REFS], [rename[p] for p in PREDS]
    expected = load(name, **options).compute(predictions=PREDS, references=REFS)
    result, peak = _peak_bytes(lambda: load(name, **options).compute(predictions=preds, references=refs))
    assert result == pytest.approx(expected)
    assert peak < 1 << 20


@pytest.mark.parametrize("name", ["f1", "precision", "recall"])
def test_binary_with_a_huge_positive_class_and_labels_beyond_the_data(name):
    big = 10**9
    small = load(name).compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 1])
    result, peak = _peak_bytes(
        lambda: load(name, pos_label=big).compute(predictions=[0, big, big, 0], references=[0, big, 0, big])
    )
    assert result == pytest.approx(small) and peak < 1 << 20
    # labels never seen count 0 in every role, as before: macro over [0, 1, unseen] is two thirds of macro over [0, 1]
    two = load(name, average="macro").compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 1])[name]
    three, peak = _peak_bytes(
        lambda: load(name, average="macro", labels=[0, 1, 10**12]).compute(
            predictions=[0, 1, 1, 0], references=[0, 1, 0, 1]
        )
    )
    assert three[name] == pytest.approx(two * 2 / 3) and peak < 1 << 20


def test_many_batches_of_huge_ids_keep_one_count_per_pair():
    metric = load("f1", average="macro")
    ids = np.array([0, 7, 10**15], dtype=np.int64)
    for step in range(50):
        metric.add_batch(predictions=np.roll(ids, step), references=ids)
    assert len(metric.counts) == 9  # 3 classes: at most 3 × 3 (true, predicted) pairs, whatever the ids
    assert metric.compute() == {"f1": pytest.approx(1 / 3, abs=0.02)}


def test_a_class_count_hint_allocates_nothing():
    _, peak = _peak_bytes(lambda: load("accuracy", num_classes=10**9).compute(predictions=[1], references=[1]))
    assert peak < 1 << 20


@pytest.mark.parametrize(
    ("predictions", "references", "message"),
    [
        (["a", "b"], [0, 1], "predictions must be class ids"),
        ([0, 1], [None, 1], "references must be class ids"),
        ([0, float("nan")], [0, 1], "predictions must be class ids"),
        ([0, float("inf")], [0, 1], "predictions must be class ids"),
        ([0, 1e300], [0, 1], "predictions must be class ids from 0 to"),
        ([[0, 1], [1]], [0, 1], "arrays of class ids or logits"),
        (np.zeros((2, 0)), [0, 1], "have no classes"),
        ([0, -3], [0, 1], "0 or more"),
    ],
)
def test_hostile_classification_inputs_are_one_value_error(predictions, references, message):
    for name in ("accuracy", "f1", "matthews_correlation"):
        with pytest.raises(ValueError, match=message) as caught:
            load(name, **({"average": "macro"} if name == "f1" else {})).compute(
                predictions=predictions, references=references
            )
        assert "\n" not in str(caught.value)


def test_perplexity_with_a_label_beyond_the_vocabulary_is_one_value_error():
    with pytest.raises(ValueError, match="label 9 is not a token id of the 4-token vocabulary"):
        load("perplexity").compute(predictions=torch.zeros(1, 3, 4), references=torch.tensor([[0, 1, 9]]))
