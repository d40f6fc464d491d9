"""``trainer-ext plan --verify``: two real optimizer steps of the top layouts on gloo processes, predicted against
measured per-rank memory and bytes per collective, each within 15 % (the JSON the command writes)."""

from __future__ import annotations

import json

import pytest

from trainer_ext.cli.main import main

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]


def test_verify_measures_the_top_layouts_within_15_percent(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "plan.json"
    job = ["--model_config", "tiny-llama", "--task", "causal-lm", "--max_seq_length", "64"]
    flags = ["--num_processes", "2", "--cpu", "--top", "2", "--per_device_train_batch_size", "2"]
    assert main(["plan", *job, *flags, "--verify", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "verify: two optimizer steps" in text
    document = json.loads(out.read_text())
    verified = document["verified"]
    assert [entry["layout"] for entry in verified] == [entry["layout"] for entry in document["layouts"]]
    assert len({entry["layout"] for entry in verified}) == 2
    for entry in verified:
        for key, (predicted, measured) in entry["memory"].items():
            assert measured > 0 and abs(predicted - measured) <= 0.15 * measured, (entry["layout"], key)
        assert entry["collectives"], entry  # a data-parallel step communicates
        for kind, (predicted, measured) in entry["collectives"].items():
            assert measured > 0 and abs(predicted - measured) <= 0.15 * measured, (entry["layout"], kind)
