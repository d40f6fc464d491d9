"""``trainer-ext estimate`` (and ``plan``, and train's start-up estimate) for ``--task sft`` and ``--task dpo``.

SFT is sized as a causal LM of ``--max_seq_length`` per sequence on the chat job's tokenizer; a DPO micro-batch of
``b`` pairs runs ``2b`` sequences through the policy and, unless LoRA, ``--reference_free`` or ``--loss_type simpo``,
holds a whole frozen reference model (its own line, "reference model"). The shapes of configs/estimate/qwen2.5-0.5b
keep the vocabulary fixed across the two tasks' data; the measured checks train a tiny model two steps on CPU with
every sequence cut to ``--max_seq_length`` (so the estimate's full-length sequences are the real ones).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex

import pytest
import torch

from tests.helpers.paths import CONFIGS
from trainer_ext.cli.main import main

QWEN = ["--model_name_or_path", str(CONFIGS / "estimate" / "qwen2.5-0.5b")]
BATCH = ["--per_device_train_batch_size", "2", "--max_seq_length", "256"]


def _estimate(tmp_path, capsys, *flags: str) -> tuple[dict, str]:
    out = tmp_path / "estimate.json"
    assert main(["estimate", *flags, "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_sft_is_sized_as_a_causal_lm_of_its_tokenizer(tmp_path, capsys) -> None:
    sft, text = _estimate(tmp_path, capsys, "--task", "sft", *QWEN, *BATCH)
    causal, _ = _estimate(tmp_path, capsys, "--task", "causal-lm", *QWEN, *BATCH)
    assert sft["estimated"] == causal["estimated"]
    assert sft["estimated"]["reference"] == 0 and "reference model" not in text
    assert "vocabulary 151936" in text and "micro-batch 2 x 256 tokens" in text


def test_a_from_scratch_sft_model_is_sized_to_the_rendered_conversations(tmp_path, capsys) -> None:
    document, text = _estimate(tmp_path, capsys, "--task", "sft", "--model_config", "tiny-llama", *BATCH)
    vocab = int(text.split("vocabulary ")[1].split()[0])
    assert 50 < vocab < 2000  # the shipped chats' words and chatml's tokens, not a preset's vocabulary
    assert 0 < document["estimated"]["weights"] < document["estimated"]["total"]


def test_dpo_runs_two_sequences_a_pair_and_holds_the_reference_whole(tmp_path, capsys) -> None:
    sft, _ = _estimate(tmp_path, capsys, "--task", "sft", *QWEN, *BATCH)
    dpo, text = _estimate(tmp_path, capsys, "--task", "dpo", *QWEN, *BATCH)
    estimated = dpo["estimated"]
    assert estimated["activations"] == 2 * sft["estimated"]["activations"]
    assert estimated["reference"] == estimated["weights"] > 0  # an fp32 copy of an fp32 model, one process
    assert estimated["total"] == sum(
        estimated[k] for k in ("weights", "gradients", "optimizer", "reference", "activations")
    )
    assert "micro-batch 2 pairs (4 sequences) x 256 tokens" in text
    assert "reference model" in text
    # FSDP2 shards the policy over the 8 ranks, not the reference: every rank holds it whole
    sharded, _ = _estimate(
        tmp_path, capsys, "--task", "dpo", *QWEN, *BATCH, "--fsdp", "full_shard", "--num_processes", "8"
    )
    assert sharded["estimated"]["reference"] == estimated["reference"]
    assert sharded["estimated"]["weights"] == pytest.approx(estimated["weights"] / 8, abs=8)


@pytest.mark.parametrize("flags", [["--reference_free", "true"], ["--loss_type", "simpo"]], ids=["free", "simpo"])
def test_no_reference_line_without_a_reference(tmp_path, capsys, flags: list[str]) -> None:
    full, _ = _estimate(tmp_path, capsys, "--task", "dpo", *QWEN, *BATCH)
    document, text = _estimate(tmp_path, capsys, "--task", "dpo", *QWEN, *BATCH, *flags)
    assert document["estimated"]["reference"] == 0 and "reference model" not in text
    assert document["estimated"]["activations"] == full["estimated"]["activations"]
    assert document["setup"]["reference_forward"] is False and full["setup"]["reference_forward"] is True
    assert document["estimated"]["peak"] < full["estimated"]["peak"] - full["estimated"]["reference"]


def test_another_reference_model_is_sized_from_its_config(tmp_path, capsys) -> None:
    own, _ = _estimate(tmp_path, capsys, "--task", "dpo", *QWEN, *BATCH)
    tiny, _ = _estimate(tmp_path, capsys, "--task", "dpo", "--model_config", "tiny-llama", *BATCH)
    flags = ["--ref_model_name_or_path", str(CONFIGS / "estimate" / "qwen2.5-0.5b")]
    other, _ = _estimate(tmp_path, capsys, "--task", "dpo", "--model_config", "tiny-llama", *BATCH, *flags)
    assert other["estimated"]["reference"] == own["estimated"]["reference"] > 1000 * tiny["estimated"]["reference"]


def test_lora_dpo_has_a_reference_forward_but_no_copy(monkeypatch) -> None:
    """The reference is the model with its adapters switched off: no weights of its own."""
    import importlib.machinery
    import sys
    import types

    from trainer_ext.estimate.job import parse_job_flags, reference_bytes
    from trainer_ext.estimate.setup import setup_from_values

    if importlib.util.find_spec("peft") is None:  # parsing only checks that peft can be found
        stand_in = types.ModuleType("peft")
        stand_in.__spec__ = importlib.machinery.ModuleSpec("peft", None)
        monkeypatch.setitem(sys.modules, "peft", stand_in)
    values, args = parse_job_flags(["--task", "dpo", "--model_config", "tiny-llama", "--lora_r", "8"], None)
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2))
    assert reference_bytes(args, model) == 0
    args.lora_r = 0
    assert reference_bytes(args, model) == 4 * sum(p.numel() for p in model.parameters())
    setup = setup_from_values(values, 1, 64)
    assert setup.sequences == 2 and setup.reference_forward


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="--lora_r builds the adapters: needs peft")
def test_lora_dpo_estimate_has_no_reference_line(tmp_path, capsys) -> None:
    document, text = _estimate(tmp_path, capsys, "--task", "dpo", *QWEN, *BATCH, "--lora_r", "8")
    assert document["estimated"]["reference"] == 0 and "reference model" not in text
    assert document["setup"]["reference_forward"] is True


def test_plan_counts_the_reference(capsys) -> None:
    flags = ["--task", "dpo", *QWEN, *BATCH, "--num_processes", "2", "--device_memory", "80GiB", "--top", "1"]
    assert main(["plan", *flags]) == 0
    assert "reference model" in capsys.readouterr().out


def test_startup_estimate_of_a_dpo_job(tmp_path, capsys) -> None:
    import trainer_ext
    from trainer_ext.job.flags import parse_train_args

    argv = ["--task", "dpo", "--model_config", "tiny-llama", "--max_steps", "1", "--output_dir", str(tmp_path)]
    argv += ["--save_strategy", "no", "--save_final_model", "false", "--validation_split_percentage", "0"]
    trainer_ext.train(parse_train_args([*argv, "--per_device_train_batch_size", "2", "--report_to", "none"]))
    block = capsys.readouterr().out.split("memory estimate per rank")[1]
    assert "micro-batch 2 pairs (4 sequences)" in block
    weights = block.split("weights")[1].split()[0:2]
    assert block.split("reference model")[1].split()[0:2] == weights  # the copy of the fp32 model, as big


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="measures a CPU run")
@pytest.mark.parametrize(
    "flags",
    [
        ["--task", "sft", "--chat_truncation", "cut", "--per_device_train_batch_size", "8"],
        ["--task", "dpo", "--per_device_train_batch_size", "4"],
    ],
    ids=["sft", "dpo"],
)
def test_measured_two_steps_agree_with_the_estimate(tmp_path, capsys, flags: list[str]) -> None:
    # 14 tokens: shorter than every shipped conversation and pair under the tiny word-level tokenizer, so every
    # sequence is cut to exactly --max_seq_length, the length the estimate counts
    document, text = _estimate(
        tmp_path, capsys, *flags, "--model_config", "tiny-llama", "--max_seq_length", "14", "--measure"
    )
    estimated, measured = document["estimated"], document["measured"]
    assert abs(estimated["total"] - measured["total"]) <= 0.15 * measured["total"], text
    assert abs(estimated["activations"] - measured["activations"]) <= 0.15 * measured["activations"], text
    if flags[1] == "dpo":
        assert measured["reference"] == pytest.approx(estimated["reference"], rel=0.01), text
        assert measured["reference"] == measured["weights"]
    else:
        assert "reference" not in measured


def _header_command(text: str) -> list[str]:
    """The ``trainer-ext estimate`` command of a recipe's header comment, continuation lines joined."""
    lines = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(lines) if line.startswith("trainer-ext estimate"))
    command = ""
    for line in lines[start:]:
        command += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            break
    return shlex.split(command)[1:]


@pytest.mark.parametrize("name", ["sft_lora", "sft_fsdp", "dpo", "cpt_packing"])
def test_each_recipes_estimate_command_prints_its_figures(name: str, capsys, monkeypatch) -> None:
    text = (CONFIGS / "recipes" / f"{name}.yaml").read_text()
    argv = _header_command(text)
    if "--lora_r" in argv and importlib.util.find_spec("peft") is None:
        pytest.skip("--lora_r builds the adapters: needs peft")
    monkeypatch.chdir(CONFIGS.parent)
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = {line[:34].strip(): line[34:].strip() for line in out.splitlines() if line.startswith("  ")}
    peak, held = re.search(r"([0-9.]+ GiB) peak \(([0-9.]+ GiB) held", text).groups()
    assert (rows["peak (+ transient buffers)"], rows["total"]) == (peak, held), out
    if name == "dpo":
        assert f"{rows['reference model']} of it the reference" in " ".join(text.split())
