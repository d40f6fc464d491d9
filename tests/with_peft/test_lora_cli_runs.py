"""``trainer-ext train --lora_r …`` for real: the built-in jobs train LoRA adapters, save only them, and reload.

Each job is the built-in one cut to a few steps. The base model of the built-in jobs is built from scratch, so the
tests rebuild it the way ``trainer_ext.train`` does (same flags, same seed) to load the adapter onto it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("peft")

import torch  # noqa: E402
import transformers  # noqa: E402
from peft import PeftModel  # noqa: E402

from trainer_ext.cli.main import main  # noqa: E402
from trainer_ext.job import run as api  # noqa: E402
from trainer_ext.job.flags import parse_train_args  # noqa: E402
from trainer_ext.job.lora import MERGED_DIR  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ADAPTER_FILES = {"adapter_model.safetensors", "adapter_config.json"}
FULL_MODEL_FILES = {"model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "config.json"}
TEXTS = {
    "sequence-classification": ["the plot was not good .", "what a wonderful film , but the ending was lovely !"],
    "causal-lm": ["anna has a red ball and", "the cat sat on"],
}
AUTO = {
    "sequence-classification": transformers.AutoModelForSequenceClassification,
    "causal-lm": transformers.AutoModelForCausalLM,
}


def job_flags(task: str, out: Path) -> list[str]:
    """The built-in job of ``task``, a few steps long, into ``out``."""
    flags = ["--task", task, "--output_dir", str(out), "--max_steps", "4", "--max_train_samples", "128"]
    flags += ["--max_eval_samples", "32", "--disable_tqdm", "true", "--learning_rate", "1e-2"]
    return flags + (["--max_seq_length", "32"] if task == "causal-lm" else [])


def files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file()}


class Capture(transformers.TrainerCallback):
    """The frozen weights at the start and the end of training, and the trained model's logits before any merge."""

    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch = batch

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.frozen_before = frozen(model)
        self.trainable = sorted(name for name, p in model.named_parameters() if p.requires_grad)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.frozen_after = frozen(model)
        self.logits = logits(model, self.batch)


def frozen(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}


@torch.no_grad()
def logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    was_training = model.training
    out = model.eval()(**batch).logits
    model.train(was_training)
    return out


def fixed_batch(task: str, flags: list[str]) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """A batch in the job's own tokenizer, and the job's base model exactly as ``trainer_ext.train`` builds it."""
    args = parse_train_args(flags)
    raw = api.load_raw_datasets(args)
    text_column, label_column = api.resolve_columns(args, raw)
    labels = api.label_names(args, raw, label_column) if label_column else None
    transformers.set_seed(args.seed)
    tokenizer = api.build_tokenizer(args, raw["train"][text_column])
    base = api.build_model(args, tokenizer, labels)
    return dict(tokenizer(TEXTS[task], padding=True, return_tensors="pt")), base


@pytest.mark.parametrize(
    ("task", "extra"),
    [("causal-lm", []), ("sequence-classification", ["--lora_target_modules", "all-linear"])],
)
def test_a_lora_job_saves_only_the_adapter_that_reloads_and_a_merged_model(
    tmp_path: Path, task: str, extra: list[str]
) -> None:
    out = tmp_path / "out"
    flags = job_flags(task, out) + ["--lora_r", "8", *extra]
    batch, base = fixed_batch(task, flags)
    base_logits = logits(base, batch)
    capture = Capture(batch)
    api.train([*flags, "--merge_lora"], callbacks=[capture])

    # only the adapters (and, for classification, peft's trainable copy of the head) trained; the base did not move
    head = ("modules_to_save",) if task == "sequence-classification" else ()
    assert capture.trainable and all(any(k in n for k in ("lora_", *head)) for n in capture.trainable)
    assert any("modules_to_save" in n for n in capture.trainable) == bool(head)
    assert capture.frozen_before.keys() == capture.frozen_after.keys()
    for name, before in capture.frozen_before.items():
        assert torch.equal(before, capture.frozen_after[name]), f"the frozen weight {name} changed"
    assert float((capture.logits - base_logits).abs().max()) > 1e-3, "the adapter must change the output"

    # output_dir holds the adapter (and tokenizer), not a full model; the merged model is in its own folder
    saved = files(out)
    assert ADAPTER_FILES <= saved and not FULL_MODEL_FILES & saved, sorted(saved)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (8, 16, 0.05)
    assert config["task_type"] == ("CAUSAL_LM" if task == "causal-lm" else "SEQ_CLS")
    if task == "sequence-classification":  # all-linear leaves the head to modules_to_save
        assert "classifier" in config["modules_to_save"] and "classifier" not in config["target_modules"]
        assert "pooler.dense" in config["target_modules"] or "dense" in " ".join(config["target_modules"])
    else:
        assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]  # peft's default for llama

    reloaded = PeftModel.from_pretrained(base, str(out))  # a base built again, the way the job built it
    torch.testing.assert_close(logits(reloaded, batch), capture.logits, rtol=0, atol=0)

    merged_dir = out / MERGED_DIR
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= files(merged_dir)
    assert not ADAPTER_FILES & files(merged_dir)
    merged = AUTO[task].from_pretrained(merged_dir)
    assert not isinstance(merged, PeftModel) and not any("lora_" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, batch), capture.logits)  # float32 round-off of W + scale * B @ A


def test_the_cli_with_a_config_file_runs_the_same_lora_job_as_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    flags = job_flags("causal-lm", out)
    lora = ["--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.0", "--lora_target_modules", "q_proj,k_proj"]
    config = tmp_path / "lora.yaml"
    config.write_text("lora_r: 4\nlora_alpha: 8\nlora_dropout: 0.0\nlora_target_modules: [q_proj, k_proj]\n")
    from_file, from_flags = parse_train_args([*flags, "--config", str(config)]), parse_train_args([*flags, *lora])
    keys = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "merge_lora")
    assert {k: getattr(from_file, k) for k in keys} == {k: getattr(from_flags, k) for k in keys}
    assert from_file.fingerprint() == from_flags.fingerprint()

    assert main(["train", *flags, "--config", str(config)]) == 0, capsys.readouterr().err
    saved = files(out)
    assert ADAPTER_FILES <= saved and not FULL_MODEL_FILES & saved and not (out / MERGED_DIR).exists()
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"]) == (4, 8, 0.0)
    assert sorted(adapter["target_modules"]) == ["k_proj", "q_proj"]
    run = json.loads((out / "trainer_ext_run.json").read_text())["job"]
    assert (run["lora_r"], run["lora_target_modules"]) == (4, ["q_proj", "k_proj"])

    # the same command again resumes nothing by accident, and a full fine-tune is a different job
    code = main(["train", *flags, "--save_strategy", "no"])
    assert code == 2 and "different job" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--lora_target_modules", "q_proj,v_prj"],
            "'v_prj' is not a module of this llama model. Did you mean 'v_proj'",
        ),
        (
            ["--model_config", "tiny-gpt2", "--lora_target_modules", "q_proj"],
            "names of its linear layers: c_attn, c_fc, c_proj",
        ),
    ],
)
def test_target_modules_not_in_the_model_exit_2_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    out = tmp_path / "out"
    code = main(["train", *job_flags("causal-lm", out), "--lora_r", "4", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "--lora_target_modules all-linear" in err and "Traceback" not in err
    assert not out.exists()


def test_a_model_type_without_peft_defaults_asks_for_target_modules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """peft knows no default targets for Phi-3: the error says to pass --lora_target_modules and lists the layers."""
    config = tmp_path / "phi3.json"
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config.write_text(json.dumps(dict(model_type="phi3", num_key_value_heads=2, max_position_embeddings=64, **sizes)))
    out = tmp_path / "out"
    code = main(["train", *job_flags("causal-lm", out), "--model_config", str(config), "--lora_r", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and not out.exists()
    assert err.startswith("error: LoRA cannot be applied to this phi3 model: ")
    assert "--lora_target_modules all-linear, or comma-separated names of its linear layers: down_proj" in err
