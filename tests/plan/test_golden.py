"""Plans for published configurations, each expected layout family argued from the arithmetic of the model.

The models are the published Llama configs (Llama 3.1 8B and 70B, Llama 3.2 1B) with a small tokenizer beside them:
the plan reads the config and builds the model on the meta device, so only the sizes matter. ``--bf16`` is the
Trainer's autocast over fp32 master weights: weights, gradients and AdamW's two moments take 16 bytes a parameter.
"""

from __future__ import annotations

import json

import pytest

from trainer_ext.cli.main import main
from trainer_ext.estimate.job import job_from_argv
from trainer_ext.plan.cluster import Cluster
from trainer_ext.plan.planner import HEADROOM, make_plan

GIB = 1 << 30
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "vocab_size": 128256,
}
MODELS = {
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_hidden_layers": 32, "tie_word_embeddings": False},
    "70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
            "num_hidden_layers": 80, "tie_word_embeddings": False},
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_hidden_layers": 16, "head_dim": 64, "tie_word_embeddings": True},
}  # fmt: skip


def _model_dir(root, name: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, **MODELS[name]}))
    words = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="</s>", pad_token="</s>")
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {name: _model_dir(root, name) for name in MODELS}


def _argv(folder: str, seq: int) -> list[str]:
    return ["--model_name_or_path", folder, "--task", "causal-lm", "--bf16", "--max_seq_length", str(seq)]


@pytest.fixture(scope="module")
def jobs(folders) -> dict[str, tuple[list[str], object]]:
    found = {}
    for name, seq in (("8b", 4096), ("70b", 4096), ("1b", 2048)):
        argv = _argv(folders[name], seq)
        found[name] = (argv, job_from_argv(argv, 1))
    return found


def _plan(jobs, name: str, cluster: Cluster, batch: int):
    argv, job = jobs[name]
    return make_plan(argv, cluster, batch, job=job)


def test_llama_8b_on_one_machine_of_8x80gb_shards_data_parallel_without_model_parallelism(jobs) -> None:
    """16 B × 8.0B = 120 GiB of states: DDP cannot hold them on an 80 GB device. Sharding the optimizer state over 8
    ranks (ZeRO-1/2: bf16 weights and gradients whole, 12 B a parameter sharded) leaves room for one 4096-token
    sequence's activations (about 25 GiB), and so does sharding everything (FSDP2, ZeRO-3: 15 GiB). Tensor, context
    or pipeline parallelism would put per-layer traffic on the critical path for no memory the device needs."""
    plan = _plan(jobs, "8b", Cluster(1, 8, 80 * GIB, "nvlink", "ib"), 64)
    assert plan.ranked
    assert not any(c.layout.family == "ddp" for c in plan.ranked)  # 120 GiB of states per device
    first = plan.ranked[0].layout
    assert first.family in ("fsdp", "zero1", "zero2", "zero3") and (first.tp, first.cp, first.pp) == (1, 1, 1), first
    assert first.data_parallel == 8 and not first.offload
    assert plan.ranked[0].memory.peak <= 80 * GIB * HEADROOM


def test_llama_8b_on_two_machines_shards_within_and_replicates_across(jobs) -> None:
    """Two machines of 8 over InfiniBand (25 GB/s against NVLink's 300): HSDP keeps the parameter all-gathers of each
    micro-batch on a machine's NVLink (8 shards fit, as above) and sends only the shard's gradient all-reduce over
    IB once per step; FSDP2 over all 16 ranks would gather every layer across machines."""
    plan = _plan(jobs, "8b", Cluster(2, 8, 80 * GIB, "nvlink", "ib"), 64)
    first = plan.ranked[0]
    assert (first.layout.family, first.layout.dp_replicate, first.layout.dp_shard) == ("hsdp", 2, 8), first.layout
    flat = [c for c in plan.ranked if c.layout.family == "fsdp" and c.layout.dp_shard == 16 and c.layout.reshard]
    assert flat and flat[0].timing.score > first.timing.score
    assert flat[0].timing.sent.get("ib", 0) > 10 * first.timing.sent["ib"]


@pytest.mark.parametrize("machines", [1, 2])
def test_llama_70b_on_8x80gb_and_on_two_machines_needs_cpu_offload(jobs, machines: int) -> None:
    """16 B × 70.6B = 1.13 TB of states: 141 GB per device over 8, above 90 % of 80 GB (72 GB) before any activation,
    and 70.6 GB over 16, which leaves under 2 GB for the layers FSDP2/ZeRO-3 gather (1.7 GB each in bf16) and the
    activations. Tensor and pipeline parallelism split the same states over the same devices, so only CPU offload
    (ZeRO-3 or FSDP2) fits, with activation checkpointing for 4096-token sequences."""
    plan = _plan(jobs, "70b", Cluster(machines, 8, 80 * GIB, "nvlink", "ib"), 64)
    assert plan.ranked, "offload fits"
    assert all(c.layout.offload for c in plan.ranked)
    first = plan.ranked[0].layout
    assert first.family in ("zero3", "fsdp") and first.checkpointing
    assert plan.job.shape.params * 16 / (8 * machines) > 70 * 10**9  # the argument above, on the model's own count


def test_llama_1b_on_4x24gb_over_pcie_shards_the_optimizer_and_keeps_layers_whole(jobs) -> None:
    """1.24B × 16 B = 18.5 GiB of states plus a 2048-token sequence's activations exceed 90 % of 24 GB, so DDP does
    not fit; sharding the optimizer state (ZeRO-1/2) or everything (FSDP2/ZeRO-3) over 4 does. Over PCIe, tensor
    parallelism's per-layer all-reduces would sit on the critical path, so the layers stay whole; the tied embeddings
    rule out the pipeline."""
    plan = _plan(jobs, "1b", Cluster(1, 4, 24 * GIB, "pcie", "ib"), 32)
    assert not any(c.layout.family == "ddp" for c in plan.ranked)
    first = plan.ranked[0].layout
    assert first.family in ("zero1", "zero2", "zero3", "fsdp") and first.tp == 1, first
    assert any(name.startswith("pp ") for name in plan.refused)  # tied embeddings


def test_a_job_that_fits_nowhere_is_refused_with_the_smallest_changes(folders, capsys) -> None:
    """70B on 4 × 24 GB with 256 GiB of host memory: no layout's device peak fits and offload needs more host
    memory; the one line names the device memory, the host memory and the devices that would do."""
    argv = ["plan", *_argv(folders["70b"], 4096), "--gpus_per_machine", "4", "--device_memory", "24GiB"]
    assert main([*argv, "--host_memory", "256GiB", "--global_batch_size", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: no layout fits 4 devices"), err
    for change in ("--device_memory ", "--host_memory ", "--gpus_per_machine "):
        assert change in err, (change, err)


def test_the_json_plan_holds_the_top_layouts_with_their_commands(folders, capsys) -> None:
    argv = ["plan", *_argv(folders["1b"], 2048), "--gpus_per_machine", "4", "--device_memory", "24GiB"]
    assert main([*argv, "--interconnect", "pcie", "--global_batch_size", "32", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["cluster"]["interconnect"] == {"within": "pcie", "between": "ib"}
    assert 1 <= len(document["layouts"]) <= 3
    first = document["layouts"][0]
    assert first["command"].startswith("trainer-ext launch --num_processes 4 train --model_name_or_path ")
    assert first["memory"]["peak"] <= 24 * GIB * HEADROOM
    assert first["micro_batch"] * first["gradient_accumulation_steps"] * 4 // first["sizes"]["tp"] == 32
    assert first["reasons"] and first["step_seconds"]["total"] > 0


def test_llama_8b_over_slow_ethernet_pipelines_across_machines_and_splits_layers_within(jobs) -> None:
    """Four machines of 8 joined by 25 GbE (3 GB/s, 100 times slower than NVLink): any data-parallel layout sends
    gradients (or FSDP's gathers) of gigabytes across machines every step, longer than the step's compute. A pipeline
    across the machines sends only each microbatch's activations between stages, and tensor parallelism keeps the
    per-layer traffic on NVLink within each machine, so the pipeline and TP together spend less time on the slow
    link than the best data-parallel layout."""
    plan = _plan(jobs, "8b", Cluster(4, 8, 80 * GIB, "nvlink", "ethernet"), 32)
    first = plan.ranked[0]
    assert first.layout.pp > 1 and first.layout.tp > 1, first.layout
    assert first.layout.tp * first.layout.cp * first.layout.pp > 8  # the pipeline spans machines
    data_parallel = [c for c in plan.ranked if (c.layout.tp, c.layout.cp, c.layout.pp) == (1, 1, 1)]
    assert data_parallel and data_parallel[0].timing.score > first.timing.score
    assert data_parallel[0].timing.sent["ethernet"] > first.timing.sent["ethernet"]
