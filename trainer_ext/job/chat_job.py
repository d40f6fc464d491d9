"""The chat jobs of ``train(args)``: ``--task sft`` (chat, instruction or plain-text SFT) and ``--task dpo``.

Rows are read into the canonical forms of ``trainer_ext.chat.formats``, rendered with the chat template, tokenized
with assistant-only labels (or as preference pairs), packed when asked, and trained by ``trainer_ext.Trainer`` (SFT)
or ``PreferenceTrainer`` (DPO, IPO, SimPO). TRL is not needed; see docs/fine-tuning-recipes.md for why.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import datasets
import transformers

from trainer_ext.chat.formats import detect_format, parse_column_mapping, to_canonical
from trainer_ext.chat.templates import BUILTIN_TEMPLATES, DEFAULT_TEMPLATE, resolve_template, template_tokens
from trainer_ext.errors import ConfigError
from trainer_ext.job.arguments import TrainJobArguments
from trainer_ext.job.building import MASTER_DTYPE, build_model, build_tokenizer, job_compute_metrics, word_level
from trainer_ext.job.lora import apply_lora
from trainer_ext.job.trainer_checks import make_trainer

logger = logging.getLogger(__name__)

# a from-scratch tokenizer's beginning and end tokens under each built-in template (the end closes an assistant turn)
SCRATCH_ENDS = {
    "chatml": (None, "<|im_end|>"),
    "qwen": (None, "<|im_end|>"),
    "llama-3": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistral": ("<s>", "</s>"),
}
SCRATCH_SPECIALS = {"pad_token": "[PAD]", "unk_token": "[UNK]"}


def chat_rows(args: TrainJobArguments, raw: datasets.DatasetDict, sources: dict[str, str]) -> datasets.DatasetDict:
    """Each split's rows in the canonical form of their format (told by the columns or ``--data_format``)."""
    mapping = parse_column_mapping(args.column_mapping)
    data_format = detect_format(raw["train"].column_names, args.task, args.data_format, mapping)
    args.data_format = data_format  # the job's fingerprint names the format read, however it was told
    if args.process_index == 0:
        logger.info("%s data: %s format", args.task, data_format)
    return datasets.DatasetDict(
        {split: to_canonical(dataset, data_format, mapping, sources[split]) for split, dataset in raw.items()}
    )


def set_up_chat(
    args: TrainJobArguments, raw: datasets.DatasetDict, callbacks: Sequence[transformers.TrainerCallback]
) -> tuple[transformers.Trainer, datasets.DatasetDict]:
    """The tokenizer, model (and reference model), tokenized data and Trainer of an sft or dpo job."""
    transformers.set_seed(args.seed)  # the same initial weights for a model from scratch on every run and rank
    tokenizer, template, added = build_chat_tokenizer(args, raw["train"])
    model = build_model(args, tokenizer, None)
    if added and args.model_name_or_path:  # the template's tokens were new to a pretrained tokenizer
        model.resize_token_embeddings(len(tokenizer))
    if args.packing:  # documents must not see each other: the model has to build its mask from position_ids
        from trainer_ext.chat.packing import check_packing_supported

        check_packing_supported(model)
    ref_model = reference_model(args, model, len(tokenizer))
    if args.lora_r:
        model = apply_lora(args, model)
    with args.main_process_first(desc="tokenizing"):
        tokenized = encode(args, raw, tokenizer, template)
    common = dict(
        model=model,
        args=args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized.get("validation"),
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )
    if args.task == "sft":
        from trainer_ext.chat.packing import SFTCollator
        from trainer_ext.trainer.trainer import Trainer

        collator = SFTCollator(pad_token_id=tokenizer.pad_token_id)
        metrics = job_compute_metrics(args, None)
        return make_trainer(Trainer, data_collator=collator, compute_metrics=metrics, **common), tokenized
    from trainer_ext.chat.preference import PreferenceCollator
    from trainer_ext.chat.preference_trainer import PreferenceTrainer

    args.remove_unused_columns = False  # the collator reads the pairs' own columns, which no forward() takes
    trainer = make_trainer(
        PreferenceTrainer,
        data_collator=PreferenceCollator(pad_token_id=tokenizer.pad_token_id),
        ref_model=ref_model,
        beta=args.beta,
        loss_type=args.loss_type,
        reference_free=args.reference_free,
        simpo_gamma=args.simpo_gamma,
        **common,
    )
    return trainer, tokenized


def encode(
    args: TrainJobArguments, raw: datasets.DatasetDict, tokenizer: Any, template: str | None
) -> datasets.DatasetDict:
    """Token ids and labels per split (SFT, packed with ``--packing``) or prompt/chosen/rejected ids (DPO)."""
    tokenized = {}
    for split, dataset in raw.items():
        source = f"the {split} data"
        if args.task == "dpo":
            from trainer_ext.chat.preference import encode_preference

            tokenized[split] = encode_preference(dataset, tokenizer, template, args.max_seq_length, source)
            continue
        from trainer_ext.chat.encode import encode_sft

        encoded, _ = encode_sft(
            dataset,
            tokenizer,
            template,
            args.max_seq_length,
            args.assistant_only_loss,
            args.chat_truncation,
            source,
        )
        if args.packing:
            from trainer_ext.chat.packing import pack_examples

            encoded = pack_examples(encoded, args.max_seq_length)
        tokenized[split] = encoded
    if len(tokenized["train"]) == 0:
        raise ConfigError(
            f"no training example is left: every row is longer than --max_seq_length {args.max_seq_length} tokens "
            "even cut to its first assistant turn (see the warning above); raise --max_seq_length or pass "
            "--chat_truncation cut"
        )
    return datasets.DatasetDict(tokenized)


def reference_model(args: TrainJobArguments, model: transformers.PreTrainedModel, vocab: int | None = None) -> Any:
    """DPO's frozen reference: ``--ref_model_name_or_path`` (its embeddings grown to ``vocab`` tokens when the
    template's tokens were added), else a copy of the initial model; none for SimPO, ``--reference_free`` or LoRA
    (whose reference is the model with its adapters switched off)."""
    if args.task != "dpo" or args.loss_type == "simpo" or args.reference_free:
        return None
    if args.ref_model_name_or_path:
        try:
            ref = transformers.AutoModelForCausalLM.from_pretrained(
                args.ref_model_name_or_path, trust_remote_code=args.trust_remote_code, dtype=MASTER_DTYPE
            )
        except (OSError, ValueError) as error:
            raise ConfigError(
                f"could not load --ref_model_name_or_path {args.ref_model_name_or_path!r}: "
                f"{' '.join(str(error).split())[:300]}"
            ) from error
        if vocab is not None and ref.get_input_embeddings().num_embeddings < vocab:
            ref.resize_token_embeddings(vocab)  # the ids of the tokens the template added: as the policy's
    elif args.lora_r:
        return None
    else:
        ref = copy.deepcopy(model)
    return ref.eval().requires_grad_(False)


def build_chat_tokenizer(args: TrainJobArguments, train: datasets.Dataset) -> tuple[Any, str | None, list[str]]:
    """The tokenizer with its chat template set, the template, and the template tokens added to its vocabulary.

    A pretrained tokenizer keeps its own template unless ``--chat_template`` names one; a built-in template's tokens
    it lacks are added (the model's embeddings grow to match). A model from scratch gets a word-level tokenizer
    trained on the rendered conversations, each template token one token.
    """
    conversational = _conversational(train)
    if args.chat_template and not conversational:
        logger.warning(
            "--chat_template %s is not used: plain-string rows are trained without a template", args.chat_template
        )
    if args.tokenizer_name or args.model_name_or_path:
        tokenizer = build_tokenizer(args, [])
        if not conversational:
            return tokenizer, None, []
        own = getattr(tokenizer, "chat_template", None)
        template = resolve_template(tokenizer, args.chat_template)
        tokenizer.chat_template = template
        name = args.chat_template or (None if own else DEFAULT_TEMPLATE)
        name = name if name in BUILTIN_TEMPLATES else None
        vocab = tokenizer.get_vocab()
        added = [token for token in (template_tokens(name) if name else []) if token not in vocab]
        if added:
            tokenizer.add_special_tokens({"additional_special_tokens": added})
            logger.warning(
                "added the %s template's tokens %s to the tokenizer; their embeddings start untrained%s",
                name,
                ", ".join(added),
                " and stay so under --lora_r (the embeddings are frozen): prefer the tokenizer's own template"
                if args.lora_r
                else "",
            )
        return tokenizer, template, added
    name = args.chat_template or DEFAULT_TEMPLATE
    return scratch_tokenizer(args, train, name if conversational else None)


def scratch_tokenizer(
    args: TrainJobArguments, train: datasets.Dataset, name: str | None
) -> tuple[Any, str | None, list]:
    """A word-level tokenizer for a model from scratch, its vocabulary the words of the rendered training rows."""
    bos, eos = SCRATCH_ENDS.get(name or "", ("[BOS]", "[EOS]"))
    specials = [*SCRATCH_SPECIALS.values(), *(t for t in (bos, eos) if t)]
    if name in BUILTIN_TEMPLATES:
        specials += [t for t in template_tokens(name) if t not in specials]
    template = None
    texts: Iterator[str] = _row_texts(train)
    if name is not None:  # render with a throwaway tokenizer: the template's own words enter the vocabulary
        probe = _fast(word_level([], specials, SCRATCH_SPECIALS["unk_token"]), args, bos, eos, [])
        template = resolve_template(probe, name)
        probe.chat_template = template
        texts = (probe.apply_chat_template(m, tokenize=False) for m in _conversations(train))
    others = [t for t in specials if t not in (bos, eos, *SCRATCH_SPECIALS.values())]
    tokenizer = _fast(word_level(texts, specials, SCRATCH_SPECIALS["unk_token"]), args, bos, eos, others)
    tokenizer.chat_template = template
    return tokenizer, template, []


def _fast(backend: Any, args: TrainJobArguments, bos: str | None, eos: str | None, others: list[str]) -> Any:
    """``backend`` as a transformers tokenizer with the job's specials."""
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=args.max_seq_length,
        bos_token=bos,
        eos_token=eos,
        additional_special_tokens=others,
        **SCRATCH_SPECIALS,
    )


def _conversational(dataset: datasets.Dataset) -> bool:
    """Whether the canonical rows are conversations (rendered by a chat template) rather than plain strings."""
    columns = dataset.column_names
    if "messages" in columns:
        return True
    return "chosen" in columns and not isinstance(dataset[0]["chosen"], str)


def _conversations(dataset: datasets.Dataset) -> Iterator[list[dict[str, str]]]:
    """Every conversation of the canonical rows (a preference pair gives its prompt with each answer)."""
    for row in dataset:
        if "messages" in row:
            yield row["messages"]
        else:
            yield list(row["prompt"]) + list(row["chosen"])
            yield list(row["prompt"]) + list(row["rejected"])


def _row_texts(dataset: datasets.Dataset) -> Iterator[str]:
    """Every string of the canonical plain rows (text, prompt/completion, preference strings)."""
    for row in dataset:
        for value in row.values():
            if isinstance(value, str):
                yield value
