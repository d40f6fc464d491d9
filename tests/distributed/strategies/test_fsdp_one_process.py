"""FSDP2 on one launched process (a process group of world size 1); test_fsdp_unlaunched.py covers one without.

Launched (torchrun --nproc_per_node 1), the Trainer and the Accelerator train under FSDP2 on a 1-rank mesh to the
weights and losses of the same job without FSDP, checkpoints are sharded and resume, and the final model is
consolidated safetensors that ``from_pretrained`` loads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from tests.distributed.strategies import fsdp_one_job
from tests.distributed.strategies.fsdp_jobs import STOP
from tests.distributed.strategies.test_fsdp import PARITY_ATOL, _max_diff
from tests.helpers.paths import CONFIGS, ROOT
from tests.helpers.ranks import child_env, run_ranks
from tests.helpers.tiny import tiny_llama


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp_one")
    run_ranks(fsdp_one_job, 1, str(out), timeout=600)
    return out


def _results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def _tensors(out: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(out / f"{name}.safetensors"))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
class TestLaunchedOneProcess:
    def test_trains_on_a_one_rank_mesh_like_the_job_without_fsdp(self, one_rank: Path) -> None:
        results = _results(one_rank)
        assert results["group_without_fsdp"] is False  # only a strategy that needs one makes the group
        assert results["world_size"] == 1 and results["mesh"] == [1]
        assert results["parallel_mode_distributed"] is True  # transformers' "fsdp only works in distributed" check
        assert results["distributed_type"] == "FSDP" and results["all_dtensors"] is True
        plain, fsdp = _tensors(one_rank, "plain"), _tensors(one_rank, "fsdp")
        assert _max_diff(plain, tiny_llama(0).state_dict()) > 1e-2, "training must move the weights"
        assert _max_diff(fsdp, plain) < PARITY_ATOL
        losses, reference = results["losses_fsdp"], results["losses_plain"]
        assert len(losses) == len(reference) == 32  # 32 samples, 1 x accumulation 2, 2 epochs
        assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) < PARITY_ATOL
        norms, plain_norms = results["grad_norms_fsdp"], results["grad_norms_plain"]
        assert len(norms) == 32 and all(n > 0 for n in norms)  # clipping saw the norm of the (one) shard
        assert max(abs(a - b) for a, b in zip(norms, plain_norms, strict=True)) < PARITY_ATOL

    def test_sharded_checkpoint_resumes_like_the_uninterrupted_run(self, one_rank: Path) -> None:
        assert _results(one_rank)["resume_steps"] == [32, 32]  # 32 samples, batch 2, 2 epochs, one process
        checkpoint = one_rank / "resume_part" / f"checkpoint-{STOP}"
        assert (checkpoint / "model_sharded" / ".metadata").is_file()
        assert (checkpoint / "optimizer_sharded" / ".metadata").is_file()
        assert not (checkpoint / "model.safetensors").exists()  # the format of N ranks
        assert _max_diff(_tensors(one_rank, "resumed"), _tensors(one_rank, "resume_full")) < 1e-6

    def test_export_is_consolidated_and_loads_with_from_pretrained(self, one_rank: Path) -> None:
        model = LlamaForCausalLM.from_pretrained(one_rank / "export")
        assert _max_diff(dict(model.state_dict()), _tensors(one_rank, "fsdp")) == 0.0
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(fsdp_one_job.PROBE)).logits
        assert torch.allclose(logits, torch.tensor(_results(one_rank)["logits"]), atol=1e-5)

    def test_accelerator_loop_with_fsdp_config(self, one_rank: Path) -> None:
        loop = _results(one_rank)["loop"]
        assert loop == {"distributed_type": "FSDP", "num_processes": 1, "use_distributed": False, "all_dtensors": True}
        plain, fsdp = _tensors(one_rank, "loop_plain"), _tensors(one_rank, "loop_fsdp")
        assert _max_diff(plain, tiny_llama(0).state_dict()) > 1e-2
        assert _max_diff(fsdp, plain) < PARITY_ATOL
        assert _max_diff(_tensors(one_rank, "loop_resumed"), fsdp) < 1e-6
        assert (one_rank / "loop_state" / "model_0" / "model_sharded" / ".metadata").is_file()
        exported = LlamaForCausalLM.from_pretrained(one_rank / "loop_export").state_dict()
        assert _max_diff(dict(exported), fsdp) == 0.0


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_trainer_ext_launch_runs_fsdp_on_one_process(tmp_path: Path) -> None:
    """``trainer-ext launch --fsdp_config PRESET train`` on one process: through torchrun, trained, exported."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "trainer_ext",
        "launch",
        "--cpu",
        "--fsdp_config",
        str(CONFIGS / "fsdp" / "full_shard.yaml"),
    ]
    cmd += [
        "train",
        "--model_config",
        "tiny-llama",
        "--task",
        "causal-lm",
        "--max_steps",
        "3",
        "--output_dir",
        str(out),
    ]
    cmd += ["--save_strategy", "steps", "--save_steps", "2", "--report_plots", "false"]
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "started through torch.distributed.run, for a process group of one" in output
    assert (out / "checkpoint-2" / "model_sharded" / ".metadata").is_file()
    model = LlamaForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) > 0
