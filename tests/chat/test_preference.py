"""Preference training: the DPO/IPO/SimPO losses against hand-computed values, preference tokenisation
(conversational and plain rows, truncation), the collator, and PreferenceTrainer on a tiny Llama (logged rewards,
exact evaluation, resume, the LoRA reference, the checkpoint without the reference, 2 gloo ranks as 1).

``python -m tests.chat.test_preference OUT`` (under 2 ranks) is the 2-process run of ``test_two_ranks_match_one``.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tests.helpers.jobs import make_args
from trainer_ext.chat.preference import (
    PreferenceCollator,
    dpo_loss,
    encode_preference,
    sequence_logps,
    simpo_loss,
)
from trainer_ext.chat.preference_trainer import PreferenceTrainer
from trainer_ext.errors import ConfigError

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QUESTIONS = [
    ("what color is the sky", "it is blue", "it is green"),
    ("where is the sun", "in the sky", "in the sea"),
    ("how many legs has a cat", "a cat has four legs", "two"),
    ("what is two plus two", "four", "five or maybe six"),
    ("name a fruit", "an apple is a fruit", "a stone"),
    ("is fire hot", "yes fire is hot", "no it is cold"),
    ("what do bees make", "bees make honey", "bees make cars"),
    ("when is it dark", "at night", "at noon when the sun is up"),
]
CONVERSATIONS = [
    {
        "prompt": [{"role": "user", "content": q}],
        "chosen": [{"role": "assistant", "content": good}],
        "rejected": [{"role": "assistant", "content": bad}],
    }
    for q, good, bad in QUESTIONS
]
CONVERSATIONS[0]["prompt"] = [{"role": "system", "content": "be brief"}, *CONVERSATIONS[0]["prompt"]]
PLAIN = [{"prompt": q, "chosen": " " + good, "rejected": " " + bad} for q, good, bad in QUESTIONS]
MAX_LEN = 64


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the rows' words, with chatml's tokens and template; eos is ``<|im_end|>``."""
    words = sorted({w for row in QUESTIONS for text in row for w in text.split()} | {"user", "assistant", "system"})
    words += ["be", "brief"]
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", *dict.fromkeys(words)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def tiny_model(vocab: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=3,
        bos_token_id=None,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def ids(tokenizer, words: str) -> list[int]:
    return tokenizer.convert_tokens_to_ids(words.split())


# --- losses --------------------------------------------------------------------------------------------------------

PC, PR, RC, RR = (
    torch.tensor([-3.0, -5.0]),
    torch.tensor([-4.0, -2.5]),
    torch.tensor([-3.5, -4.0]),
    torch.tensor([-3.0, -3.0]),
)


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_sigmoid_loss_by_hand() -> None:
    got = dpo_loss(PC, PR, RC, RR, beta=0.1, loss_type="sigmoid")
    for i in range(2):
        delta = (PC[i] - RC[i]) - (PR[i] - RR[i])
        assert got[i].item() == pytest.approx(-_logsig(0.1 * delta.item()), rel=1e-6)


def test_label_smoothing_by_hand() -> None:
    got = dpo_loss(PC, PR, RC, RR, beta=0.5, loss_type="sigmoid", label_smoothing=0.2)
    delta = ((PC - RC) - (PR - RR)).tolist()
    want = [-0.8 * _logsig(0.5 * d) - 0.2 * _logsig(-0.5 * d) for d in delta]
    assert got.tolist() == pytest.approx(want, rel=1e-6)


def test_ipo_loss_by_hand() -> None:
    got = dpo_loss(PC, PR, RC, RR, beta=0.25, loss_type="ipo")
    delta = ((PC - RC) - (PR - RR)).tolist()
    assert got.tolist() == pytest.approx([(d - 1 / 0.5) ** 2 for d in delta], rel=1e-6)


def test_reference_free_is_reference_zero() -> None:
    got = dpo_loss(PC, PR, 0.0, 0.0, beta=0.1, loss_type="sigmoid")
    want = [-_logsig(0.1 * (c - r)) for c, r in zip(PC.tolist(), PR.tolist(), strict=True)]
    assert got.tolist() == pytest.approx(want, rel=1e-6)


def test_simpo_loss_by_hand() -> None:
    got = simpo_loss(torch.tensor([-0.5, -1.2]), torch.tensor([-0.9, -0.4]), beta=2.0, gamma=0.5)
    want = [-_logsig(2.0 * (-0.5 + 0.9) - 0.5), -_logsig(2.0 * (-1.2 + 0.4) - 0.5)]
    assert got.tolist() == pytest.approx(want, rel=1e-6)


def test_bad_loss_settings() -> None:
    with pytest.raises(ConfigError, match="sigmoid or ipo"):
        dpo_loss(PC, PR, RC, RR, beta=0.1, loss_type="hinge")
    with pytest.raises(ConfigError, match="sigmoid loss only"):
        dpo_loss(PC, PR, RC, RR, beta=0.1, loss_type="ipo", label_smoothing=0.1)


def test_sequence_logps_by_hand() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 6)
    labels = torch.tensor([[-100, 2, 5, -100], [-100, -100, 1, 3]])
    logp = logits.log_softmax(-1)
    want = [logp[0, 0, 2] + logp[0, 1, 5], logp[1, 1, 1] + logp[1, 2, 3]]
    assert sequence_logps(logits, labels).tolist() == pytest.approx([w.item() for w in want], rel=1e-6)
    assert sequence_logps(logits, labels, average=True).tolist() == pytest.approx([w.item() / 2 for w in want])


# --- tokenisation ----------------------------------------------------------------------------------------------------


def test_encode_conversational_rows() -> None:
    tok = chat_tokenizer()
    out = encode_preference(Dataset.from_list(CONVERSATIONS), tok, None, MAX_LEN, "test rows")
    assert out.column_names == ["prompt_input_ids", "chosen_input_ids", "rejected_input_ids"]
    first = "<|im_start|> system be brief <|im_end|> <|im_start|> user what color is the sky <|im_end|>"
    assert out[0]["prompt_input_ids"] == ids(tok, first + " <|im_start|> assistant")
    assert out[0]["chosen_input_ids"] == ids(tok, "it is blue <|im_end|>")
    assert out[0]["rejected_input_ids"] == ids(tok, "it is green <|im_end|>")
    assert out[1]["prompt_input_ids"] == ids(
        tok, "<|im_start|> user where is the sun <|im_end|> <|im_start|> assistant"
    )


def test_encode_template_argument_overrides_the_tokenizer() -> None:
    tok = chat_tokenizer()
    tok.chat_template = None
    with pytest.raises(ConfigError, match="chat template"):
        encode_preference(Dataset.from_list(CONVERSATIONS[:1]), tok, None, MAX_LEN, "rows")
    out = encode_preference(Dataset.from_list(CONVERSATIONS[1:2]), tok, CHATML, MAX_LEN, "rows")
    assert out[0]["chosen_input_ids"] == ids(tok, "in the sky <|im_end|>")


def test_encode_plain_rows_and_implicit_prompt() -> None:
    tok = chat_tokenizer()
    out = encode_preference(Dataset.from_list(PLAIN[:2]), tok, None, MAX_LEN, "rows")
    assert out[0]["prompt_input_ids"] == ids(tok, "what color is the sky")
    assert out[0]["chosen_input_ids"] == ids(tok, "it is blue <|im_end|>")  # eos appended, as TRL
    explicit = [{"prompt": "the sky is", "chosen": " blue", "rejected": " green"}]
    implicit = [{"chosen": "the sky is blue", "rejected": "the sky is green"}]  # the shared prefix is the prompt
    want = encode_preference(Dataset.from_list(explicit), tok, None, MAX_LEN, "rows").to_list()
    assert encode_preference(Dataset.from_list(implicit), tok, None, MAX_LEN, "rows").to_list() == want
    assert want[0]["prompt_input_ids"] == ids(tok, "the sky is")


def test_encode_bad_rows() -> None:
    tok = chat_tokenizer()
    with pytest.raises(ConfigError, match="'chosen' and 'rejected' columns"):
        encode_preference(Dataset.from_list([{"prompt": "a", "good": "b"}]), tok, None, MAX_LEN, "rows")
    mixed = [{"prompt": "what", "chosen": [{"role": "assistant", "content": "x"}], "rejected": "y"}]
    with pytest.raises(ConfigError, match="row 0 mixes"):
        encode_preference(mixed, tok, None, MAX_LEN, "rows")


def test_truncation_cuts_drops_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    tok = chat_tokenizer()
    rows = [
        {"prompt": "is fire hot", "chosen": " yes", "rejected": " no it is cold"},  # 3 + 5 tokens: cut to 6
        {"prompt": "what color is the sky", "chosen": " blue", "rejected": " green"},  # prompt 5: fits (7 > 6: cut)
        {"prompt": "how many legs has a cat", "chosen": " four", "rejected": " two"},  # prompt 6: dropped
        {"prompt": "name", "chosen": " four", "rejected": " two"},  # 1 + 2: fits
    ]
    with caplog.at_level(logging.WARNING, logger="trainer_ext.chat.preference"):
        out = encode_preference(rows, tok, None, 6, "rows")
    assert len(out) == 3
    assert out[0]["chosen_input_ids"] == ids(tok, "yes <|im_end|>")
    assert out[0]["rejected_input_ids"] == ids(tok, "no it is")
    assert out[1]["chosen_input_ids"] == ids(tok, "blue")
    lines = [r.getMessage() for r in caplog.records if "longer than" in r.getMessage()]
    assert len(lines) == 1
    assert "3 of 4 preference pairs longer than 6 tokens: 2 cut" in lines[0] and "1 dropped" in lines[0]


def test_pairs_with_an_empty_prompt_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    tok = chat_tokenizer()  # no bos: an empty prompt tokenizes to no ids
    rows = [
        {"prompt": "", "chosen": "it is blue", "rejected": "it is green"},
        {"chosen": "four", "rejected": "five"},  # no shared prefix: the extracted prompt is empty
        {"prompt": "name a fruit", "chosen": " an apple", "rejected": " a stone"},
    ]
    with caplog.at_level(logging.WARNING, logger="trainer_ext.chat.preference"):
        out = encode_preference(rows, tok, None, MAX_LEN, "rows")
    assert out["prompt_input_ids"] == [ids(tok, "name a fruit")]
    lines = [r.getMessage() for r in caplog.records if "empty tokenized prompt" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("rows: 2 of 3 preference pairs dropped with an empty")
    with pytest.raises(ConfigError, match="no preference pair left to train on: 0 of 2 .* 2 have an empty prompt"):
        encode_preference(rows[:2], tok, None, MAX_LEN, "rows")


def test_collator_without_a_pad_token_says_so() -> None:
    with pytest.raises(ConfigError, match="needs a pad_token_id to pad preference pairs with, got None"):
        PreferenceCollator(None)


def test_collator_pads_pairs_to_one_width() -> None:
    batch = PreferenceCollator(0)(
        [
            {"prompt_input_ids": [5, 6], "chosen_input_ids": [7], "rejected_input_ids": [8, 9, 10]},
            {"prompt_input_ids": [4], "chosen_input_ids": [11, 12], "rejected_input_ids": [13]},
        ]
    )
    assert batch["chosen_input_ids"].tolist() == [[5, 6, 7, 0, 0], [4, 11, 12, 0, 0]]
    assert batch["rejected_input_ids"].tolist() == [[5, 6, 8, 9, 10], [4, 13, 0, 0, 0]]
    assert batch["chosen_labels"].tolist() == [[-100, -100, 7, -100, -100], [-100, 11, 12, -100, -100]]
    assert batch["rejected_attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]


# --- PreferenceTrainer -----------------------------------------------------------------------------------------------


def _trainer(out: Path, model=None, ref_model="copy", rows=CONVERSATIONS, **kwargs) -> PreferenceTrainer:
    tok = chat_tokenizer()
    model = model if model is not None else tiny_model(len(tok))
    if ref_model == "copy":
        ref_model = copy.deepcopy(model)
    options = dict(per_device_train_batch_size=4, max_steps=4, learning_rate=5e-2, lr_scheduler_type="constant")
    options.update(kwargs.pop("args", {}))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    options["per_device_train_batch_size"] //= world
    data = encode_preference(Dataset.from_list(rows), tok, None, MAX_LEN, "rows")
    return PreferenceTrainer(
        model=model,
        args=make_args(out, **options),
        train_dataset=data,
        eval_dataset=kwargs.pop("eval_dataset", None),
        processing_class=tok,
        ref_model=ref_model,
        **kwargs,
    )


def _logs(trainer: PreferenceTrainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_training_logs_rewards_and_learns(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    trainer.train()
    logs = _logs(trainer)
    assert len(logs) == 4
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert all(math.isfinite(entry[key]) for entry in logs), key
    # step 1: the policy is the reference, so every reward is 0, no pair is ranked right and the loss is log 2
    assert logs[0]["rewards/margins"] == 0.0 and logs[0]["rewards/accuracies"] == 0.0
    assert logs[0]["loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert logs[-1]["rewards/margins"] > 0 and logs[-1]["rewards/accuracies"] > 0.5
    assert logs[-1]["loss"] < math.log(2)
    margin = logs[-1]["rewards/chosen"] - logs[-1]["rewards/rejected"]
    assert logs[-1]["rewards/margins"] == pytest.approx(margin, rel=1e-5)


def test_bf16_reference_runs_in_the_policys_precision(tmp_path: Path) -> None:
    """Under --bf16 the policy's forward runs under autocast; the reference, equal to the initial policy, must too:
    step 1's rewards are then 0 and its loss log 2 exactly."""
    trainer = _trainer(tmp_path, args={"bf16": True, "max_steps": 1})
    trainer.train()
    first = _logs(trainer)[0]
    assert first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0 and first["rewards/margins"] == 0.0
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_ipo_normalises_by_the_predicted_response_tokens(tmp_path: Path) -> None:
    """IPO's per-token average divides by the response tokens a logit predicts (labels[:, 1:]), here with a pair
    whose response starts at position 0 (its first token is not predicted)."""
    tok = chat_tokenizer()
    model, ref = tiny_model(len(tok)), tiny_model(len(tok), seed=1)
    trainer = _trainer(tmp_path, model=model, ref_model=ref, loss_type="ipo")
    batch = PreferenceCollator(0)(
        [
            {"prompt_input_ids": [], "chosen_input_ids": [5, 6, 7], "rejected_input_ids": [8, 9]},
            {"prompt_input_ids": [4, 5], "chosen_input_ids": [10], "rejected_input_ids": [11, 12, 13]},
        ]
    )
    trainer.model.eval()
    with torch.no_grad():
        got = trainer.compute_loss(trainer.model, batch).item()
        avg = [
            sequence_logps(
                m(input_ids=batch[f"{s}_input_ids"], attention_mask=batch[f"{s}_attention_mask"]).logits,
                batch[f"{s}_labels"],
                average=True,
            )
            for m in (model, ref)
            for s in ("chosen", "rejected")
        ]
    assert got == pytest.approx(dpo_loss(*avg, beta=0.1, loss_type="ipo").mean().item(), rel=1e-6)


@pytest.mark.parametrize("loss_type", ["ipo", "simpo"])
def test_other_losses_train(tmp_path: Path, loss_type: str) -> None:
    ref = None if loss_type == "simpo" else "copy"
    trainer = _trainer(tmp_path, ref_model=ref, loss_type=loss_type, args={"max_steps": 2})
    trainer.train()
    assert all(math.isfinite(entry["loss"]) for entry in _logs(trainer))


def test_a_reference_is_required(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs a reference model"):
        _trainer(tmp_path, ref_model=None)
    trainer = _trainer(tmp_path, ref_model=None, reference_free=True, args={"max_steps": 1})
    trainer.train()
    assert _logs(trainer)[0]["rewards/chosen"] < 0  # beta x the log-probability itself: no reference to subtract


def test_exact_eval_loss_is_the_mean_over_pairs(tmp_path: Path) -> None:
    tok = chat_tokenizer()
    eval_rows = encode_preference(Dataset.from_list(CONVERSATIONS[:5]), tok, None, MAX_LEN, "eval")
    trainer = _trainer(
        tmp_path,
        ref_model=tiny_model(len(tok), seed=1),  # not the policy: rewards that differ from pair to pair
        eval_dataset=eval_rows,
        args={"per_device_eval_batch_size": 2, "exact_eval_loss": True},
    )
    metrics = trainer.evaluate()
    batch = PreferenceCollator(0)(eval_rows.to_list())
    model, ref = trainer.model, trainer.ref_model
    with torch.no_grad():
        logps = [
            sequence_logps(
                m(input_ids=batch[f"{s}_input_ids"], attention_mask=batch[f"{s}_attention_mask"]).logits,
                batch[f"{s}_labels"],
            )
            for m in (model, ref)
            for s in ("chosen", "rejected")
        ]
    want = dpo_loss(*logps, beta=0.1, loss_type="sigmoid").mean().item()
    assert metrics["eval_loss"] == pytest.approx(want, rel=1e-5)
    # the metrics are means over the 5 pairs (not over the batches of 2, 2 and 1 pairs)
    chosen, rejected = 0.1 * (logps[0] - logps[2]), 0.1 * (logps[1] - logps[3])
    assert metrics["eval_rewards/margins"] == pytest.approx((chosen - rejected).mean().item(), rel=1e-5)
    assert metrics["eval_rewards/accuracies"] == pytest.approx((chosen > rejected).double().mean().item())
    assert metrics["eval_logps/chosen"] == pytest.approx(logps[0].mean().item(), rel=1e-5)
    assert 0 < metrics["eval_rewards/accuracies"] < 1  # the pairs differ: a count that can be wrong


def test_resume_is_bitwise(tmp_path: Path) -> None:
    full = _trainer(tmp_path / "full")
    full.train()
    save = {"save_strategy": "steps", "save_steps": 2}
    first = _trainer(tmp_path / "cut", args={**save, "max_steps": 4})
    from tests.helpers.jobs import StopAt

    first.add_callback(StopAt(2))
    first.train()
    resumed = _trainer(tmp_path / "cut", args={**save, "max_steps": 4})
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    for (name, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # the resumed history starts with the checkpoint's two steps
    assert [e["loss"] for e in _logs(full)] == [e["loss"] for e in _logs(resumed)]
    assert [e["rewards/margins"] for e in _logs(full)] == [e["rewards/margins"] for e in _logs(resumed)]


def test_checkpoint_holds_the_policy_only(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, args={"save_strategy": "steps", "save_steps": 2, "max_steps": 2})
    before = {k: v.clone() for k, v in trainer.ref_model.state_dict().items()}
    trainer.train()
    saved = load_file(tmp_path / "checkpoint-2" / "model.safetensors")
    policy = trainer.model.state_dict()
    assert set(saved) <= set(policy) and len(saved) >= len(policy) - 1  # tied lm_head may be left out
    assert all(torch.equal(saved[k], policy[k]) for k in saved)
    assert all(torch.equal(before[k], v) for k, v in trainer.ref_model.state_dict().items())  # frozen
    assert not torch.equal(saved["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert not trainer.ref_model.training and not any(p.requires_grad for p in trainer.ref_model.parameters())


def test_lora_reference_is_the_model_without_adapters(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft", reason="peft is not installed")
    tok = chat_tokenizer()

    def lora(base):
        torch.manual_seed(1)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return peft.get_peft_model(base, config)

    adapters_off = _trainer(tmp_path / "off", model=lora(tiny_model(len(tok))), ref_model=None)
    adapters_off.train()
    base = tiny_model(len(tok))
    explicit = _trainer(tmp_path / "ref", model=lora(copy.deepcopy(base)), ref_model=base)
    explicit.train()
    losses_off, losses_ref = [e["loss"] for e in _logs(adapters_off)], [e["loss"] for e in _logs(explicit)]
    assert losses_off == pytest.approx(losses_ref, rel=1e-6)
    # the adapter trained (LoRA's B starts at 0) while the reference stayed the base model
    trained = [p for name, p in adapters_off.model.named_parameters() if "lora_B" in name]
    assert trained and any(p.abs().sum() > 0 for p in trained)
    assert _logs(adapters_off)[-1]["rewards/margins"] != 0.0


# --- 2 gloo ranks ----------------------------------------------------------------------------------------------------


EVAL_KEYS = ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins", "eval_logps/chosen", "eval_logits/chosen")


def _run_job(out: Path) -> dict:
    tok = chat_tokenizer()
    # 5 pairs, 2 per device: on 2 ranks the last round holds 1 real pair and 3 repeats, and exact evaluation runs
    # each rank's real pairs once more
    rows = [dict(row) for row in CONVERSATIONS[3:]]
    for row in rows[::2]:  # chosen and rejected swapped: pairs the trained policy ranks wrong
        row["chosen"], row["rejected"] = row["rejected"], row["chosen"]
    eval_rows = encode_preference(Dataset.from_list(rows), tok, None, MAX_LEN, "eval")
    trainer = _trainer(out, eval_dataset=eval_rows, args={"per_device_eval_batch_size": 2, "exact_eval_loss": True})
    trainer.train()
    result = {key: [entry[key] for entry in _logs(trainer)] for key in ("loss", "rewards/margins", "logps/chosen")}
    metrics = trainer.evaluate()  # the trained policy against the initial one: rewards that differ between pairs
    result.update({key: [metrics[key]] for key in EVAL_KEYS})
    ddp = torch.nn.parallel.DistributedDataParallel
    # the policy is wrapped for data parallelism, the frozen reference is not
    result["wrapped"] = [isinstance(trainer.model_wrapped, ddp), isinstance(trainer.ref_model, ddp)]
    return result


def test_two_ranks_match_one(tmp_path: Path) -> None:
    from tests.helpers.ranks import run_ranks

    one = _run_job(tmp_path / "one")
    run_ranks("tests.chat.test_preference", 2, str(tmp_path / "two"), timeout=600)
    two = json.loads((tmp_path / "two" / "result.json").read_text())
    assert one.pop("wrapped") == [False, False] and two.pop("wrapped") == [True, False]
    assert 0 < one["eval_rewards/accuracies"][0] < 1
    for key, values in one.items():
        near = 1e-5 if "logits" in key else 1e-7  # a mean logit near 0 carries the trained weights' rounding
        assert two[key] == pytest.approx(values, rel=1e-5, abs=near), key


def main(out: str) -> None:
    from trainer_ext.distributed.state import destroy_process_group

    result = _run_job(Path(out))
    if int(os.environ.get("RANK", "0")) == 0:
        (Path(out) / "result.json").write_text(json.dumps(result))
    destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
