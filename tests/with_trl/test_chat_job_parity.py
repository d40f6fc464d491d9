"""``trainer_ext.train(["--task", "sft"|"dpo", ...])`` against TRL's own SFTTrainer / DPOTrainer, as a user meets them.

One "pretrained model" on disk (a tiny Llama built from a config, sdpa, dropout 0, and a hub-free word-level tokenizer
with the chatml template, whose generation markers give the assistant mask) and the shipped chat and preference
data (first rows, written to jsonl). Our side is the job with its flags; the stock side is TRL 1.16's trainer (on
accelerate, in this process, as tests/with_trl/test_dpo_parity.py runs it) with the same hyperparameters and the
TRL-only defaults that would make it another run set as the job has them: ``bf16=False`` (TRL: True),
``gradient_checkpointing=False`` (TRL: True), the learning rate, schedule, seed and logging. Compared: the per-step
training losses (and DPO's reward accuracies and margins) over 4 optimizer steps, the learning rates, and the number
of training examples (rows kept, or packed blocks).

Not bitwise, ~1e-7 relative: TRL 1.16's SFT loss sums its fused head's per-token log-probs, ours is the model's own
cross-entropy; DPO's log-prob sums come from each side's own code. Packed (``--packing true`` / ``packing=True``, bfd): the
same blocks (tests/with_trl/test_chat_packing_parity.py), batched by TRL padding-free as one flattened row and by us
one row per block, right-padded; both give each document its own causal mask from position_ids and average over the
same label tokens, so the losses compare as they are.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
import transformers  # noqa: E402
from datasets import load_dataset  # noqa: E402

import trainer_ext  # noqa: E402
from tests.chat.tokenizer_kit import word_level  # noqa: E402
from trainer_ext.chat.templates import BUILTIN_TEMPLATES  # noqa: E402
from trainer_ext.job.builtin_data import CHAT, PREFERENCES  # noqa: E402

ROWS = 48
STEPS = 4
MAX_LEN = 128
LOSS_RTOL = 1e-6
SHARED = dict(  # the same run on both sides: the job's flags, TRL's config fields
    max_steps=STEPS,
    per_device_train_batch_size=4,
    learning_rate=1e-3,
    lr_scheduler_type="linear",
    warmup_steps=0,
    weight_decay=0.0,
    logging_steps=1,
    save_strategy="no",
    seed=0,
)
DPO_METRICS = ("rewards/accuracies", "rewards/margins")


def _head(path: Path, n: int = ROWS) -> list[dict]:
    with path.open() as lines:
        return [json.loads(line) for line in itertools.islice(lines, n)]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _texts(rows: list[dict]) -> list[str]:
    out = []
    for row in rows:
        for value in row.values():
            out += [value] if isinstance(value, str) else [m["content"] for m in value]
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The pretrained model directory and the data files: messages, prompt/completion strings, preferences."""
    base = tmp_path_factory.mktemp("chat_job_parity")
    chat, preferences = _head(CHAT), _head(PREFERENCES)
    plain = [  # each conversation's first exchange as plain strings
        {"prompt": row["messages"][0]["content"], "completion": " " + row["messages"][1]["content"]} for row in chat
    ]
    tokenizer = word_level(_texts(chat) + _texts(preferences), "chatml", post_process=True)
    tokenizer.chat_template = BUILTIN_TEMPLATES["chatml"]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=len(tokenizer),
        max_position_embeddings=2 * MAX_LEN,
        attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    model_dir = base / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return {
        "model": model_dir,
        "messages": _write(base / "chat.jsonl", chat),
        "prompt-completion": _write(base / "plain.jsonl", plain),
        "preference": _write(base / "preferences.jsonl", preferences),
    }


class _Logs(transformers.TrainerCallback):
    """The job's per-step training logs."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append(dict(logs))


def _ours(out: Path, files: dict[str, Path], task: str, data: str, *extra: str) -> tuple[list[dict], int]:
    """The job's per-step logs and its number of training examples (rows kept, or packed blocks)."""
    flags = [
        "--task",
        task,
        "--model_name_or_path",
        str(files["model"]),
        "--train_file",
        str(files[data]),
        "--validation_split_percentage",
        "0",
        "--max_seq_length",
        str(MAX_LEN),
        "--output_dir",
        str(out),
        "--report_plots",
        "false",
        *extra,
    ]
    for key, value in SHARED.items():
        flags += [f"--{key}", str(value)]
    logs = _Logs()
    metrics = trainer_ext.train(flags, callbacks=[logs])
    return logs.logs, int(metrics["train_samples"])


def _stock(trainer) -> tuple[list[dict], int]:
    """TRL's per-step logs and its number of training examples."""
    import accelerate

    assert isinstance(trainer.accelerator, accelerate.Accelerator)  # TRL's own stack, not trainer_ext's engine
    examples = len(trainer.train_dataset)
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry], examples


def _load(files: dict[str, Path]):
    return transformers.AutoModelForCausalLM.from_pretrained(files["model"])


def _trl_sft(out: Path, files: dict[str, Path], data: str, packing: bool = False) -> tuple[list[dict], int]:
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(out),
        max_length=MAX_LEN,
        assistant_only_loss=data == "messages",  # prompt/completion rows: completion-only loss by default
        packing=packing,  # bfd, padding-free: the batch's blocks flattened into one row
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        **SHARED,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(files["model"])
    rows = load_dataset("json", data_files=str(files[data]))["train"]
    return _stock(SFTTrainer(model=_load(files), args=args, train_dataset=rows, processing_class=tokenizer))


def _trl_dpo(out: Path, files: dict[str, Path]) -> tuple[list[dict], int]:
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(out),
        beta=0.1,
        loss_type="sigmoid",
        max_length=MAX_LEN,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        **SHARED,
    )
    trainer = DPOTrainer(
        model=_load(files),
        ref_model=_load(files),
        args=args,
        train_dataset=load_dataset("json", data_files=str(files["preference"]))["train"],
        processing_class=transformers.AutoTokenizer.from_pretrained(files["model"]),
    )
    return _stock(trainer)


def _worst(ours: list[dict], theirs: list[dict]) -> float:
    """The largest relative loss difference over the steps (asserting the step counts, the learning rates and that
    it trained)."""
    assert len(ours) == len(theirs) == STEPS, (ours, theirs)
    assert [a["learning_rate"] for a in ours] == [b["learning_rate"] for b in theirs]
    assert ours[-1]["loss"] != ours[0]["loss"]  # it trained: not 4 identical steps
    return max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize(
    ("data", "extra"),
    [("messages", ()), ("prompt-completion", ()), ("messages", ("--packing", "true"))],
    ids=["messages", "prompt-completion", "messages-packed"],
)
def test_sft_job_matches_trl_sft_trainer(tmp_path: Path, files: dict[str, Path], data: str, extra: tuple) -> None:
    theirs, their_examples = _trl_sft(tmp_path / "trl", files, data, packing=bool(extra))
    ours, our_examples = _ours(tmp_path / "ours", files, "sft", data, *extra)
    assert our_examples == their_examples  # the same rows kept (or the same number of packed blocks)
    if extra:
        assert our_examples < ROWS // 2  # packed: several conversations a block
    worst = _worst(ours, theirs)
    print(f"sft {data} {extra}: max relative loss difference {worst:.3g}")
    assert worst <= LOSS_RTOL, ([o["loss"] for o in ours], [t["loss"] for t in theirs])


def test_dpo_job_matches_trl_dpo_trainer(tmp_path: Path, files: dict[str, Path]) -> None:
    theirs, their_examples = _trl_dpo(tmp_path / "trl", files)
    ours, our_examples = _ours(
        tmp_path / "ours", files, "dpo", "preference", "--beta", "0.1", "--loss_type", "sigmoid"
    )
    assert our_examples == their_examples == ROWS
    worst = _worst(ours, theirs)
    print(f"dpo: max relative loss difference {worst:.3g}")
    assert worst <= LOSS_RTOL, ([o["loss"] for o in ours], [t["loss"] for t in theirs])
    # a margin is beta * (a difference of log-prob differences, each ~35 in fp32): an absolute 1e-6 is its precision
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True), start=1):
        for key in DPO_METRICS:
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (step, key, a[key], b[key])
    gap = max(abs(a[key] - b[key]) for a, b in zip(ours, theirs, strict=True) for key in DPO_METRICS)
    print(f"dpo: max absolute difference of {', '.join(DPO_METRICS)} {gap:.3g}")
