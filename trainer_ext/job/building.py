"""What a job builds besides its data: the tokenizer, the model (pretrained or from a config) and the metrics."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import transformers

from trainer_ext.errors import ConfigError
from trainer_ext.job.arguments import DEFAULT_PRESET, PRESETS, TrainJobArguments
from trainer_ext.job.model_limits import check_model_config, load_model_config
from trainer_ext.metrics.for_trainer import TrainerMetrics, build_metrics

logger = logging.getLogger(__name__)

# a pretrained model's weights load in float32 whatever dtype its checkpoint was stored in (transformers would keep a
# bf16 checkpoint in bf16): they are the optimizer's master copy, --bf16/--fp16 compute in half precision around them
MASTER_DTYPE = "float32"

# Specials of the word-level tokenizer built for models trained from scratch, in id order.
SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "bos": "[BOS]", "eos": "[EOS]"}


def build_tokenizer(args: TrainJobArguments, texts: Sequence[str]) -> transformers.PreTrainedTokenizerBase:
    """The named or the model's tokenizer; for a model from scratch, a word-level one built from the texts."""
    name = args.tokenizer_name or args.model_name_or_path
    if name:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)
        except (OSError, ValueError) as error:
            raise ConfigError(
                f"could not load the tokenizer {name!r}: {' '.join(str(error).split())[:400]}"
            ) from error
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        return tokenizer
    from tokenizers import processors

    backend = word_level(texts, list(SPECIAL_TOKENS.values()), SPECIAL_TOKENS["unk"])
    first, last = ("[CLS]", "[SEP]") if args.task == "sequence-classification" else ("[BOS]", "[EOS]")
    backend.post_processor = processors.TemplateProcessing(
        single=f"{first} $A {last}",
        pair=f"{first} $A {last} $B {last}",
        special_tokens=[(first, backend.token_to_id(first)), (last, backend.token_to_id(last))],
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=args.max_seq_length,
        **{f"{role}_token": token for role, token in SPECIAL_TOKENS.items()},
    )


def build_model(
    args: TrainJobArguments, tokenizer: transformers.PreTrainedTokenizerBase, labels: list[str] | None
) -> transformers.PreTrainedModel:
    """Load the pretrained model, or build a new one from the config/preset sized to the tokenizer."""
    auto = transformers.AutoModelForSequenceClassification if labels else transformers.AutoModelForCausalLM
    label_kwargs = (
        dict(num_labels=len(labels), id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)})
        if labels
        else {}
    )
    try:
        if args.model_name_or_path:
            model = auto.from_pretrained(
                args.model_name_or_path, trust_remote_code=args.trust_remote_code, dtype=MASTER_DTYPE, **label_kwargs
            )
        else:
            config = model_config(args)
            config.update(dict(vocab_size=vocab_for(args, len(tokenizer)), **label_kwargs))
            config.pad_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.bos_token_id
            config.eos_token_id = tokenizer.eos_token_id
            if labels is None and config.model_type == "bert":
                config.is_decoder = True
            check_model_config(config, f"--model_config {args.model_config or DEFAULT_PRESET[args.task]}")
            model = auto.from_config(config, trust_remote_code=args.trust_remote_code)
    except ConfigError:
        raise
    except (OSError, ValueError) as error:
        what = args.model_name_or_path or args.model_config or "the preset"
        raise ConfigError(
            f"could not build a {args.task} model from {what!r}: {' '.join(str(error).split())[:400]}"
        ) from error
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def vocab_for(args: TrainJobArguments, size: int) -> int:
    """A model from scratch's vocabulary: the tokenizer's ``size``, rounded up to a multiple of the tensor-parallel
    size (the plan splits the embedding by rows; the ids above ``size`` never occur)."""
    config = getattr(args, "parallelism_config", None)
    tp_size = getattr(args, "tp_size", None) or (config.tp_size if config is not None else 1)
    padded = -(-size // tp_size) * tp_size
    if padded != size and args.process_index == 0:
        logger.info("vocab_size %d padded to %d, a multiple of tp_size %d", size, padded, tp_size)
    return padded


def model_config(args: TrainJobArguments) -> transformers.PretrainedConfig:
    """The config of a model to build from scratch: a preset, a config.json file, or a directory holding one."""
    name = args.model_config or DEFAULT_PRESET[args.task]
    if name in PRESETS:
        values = dict(PRESETS[name])
        positions = max(values.get("max_position_embeddings", values.get("n_positions", 0)), args.max_seq_length)
        values["n_positions" if "n_positions" in values else "max_position_embeddings"] = positions
        return transformers.AutoConfig.for_model(**values)
    return load_model_config(name)


def job_compute_metrics(args: TrainJobArguments, labels: list[str] | None) -> TrainerMetrics | None:
    """``compute_metrics`` for ``--metrics`` (default: accuracy for a classifier; none for causal-lm, whose perplexity
    comes from eval_loss), streamed per batch with transformers' ``batch_eval_metrics`` so no logits pile up."""
    names = args.metrics if args.metrics is not None else (["accuracy"] if labels else [])
    if not names:
        return None
    try:
        task = "causal-lm" if args.task == "sft" else args.task  # an SFT job's metrics are a causal LM's
        metrics = build_metrics(task, names, num_classes=len(labels or []), average=args.metrics_average)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    if labels and len(labels) > 2 and any(getattr(m, "average", None) == "binary" for m in metrics):
        raise ConfigError(
            f"--metrics_average binary scores one class of two, but the data has {len(labels)} classes; "
            "pass --metrics_average macro, micro or weighted"
        )
    args.batch_eval_metrics = True
    return TrainerMetrics(metrics)


def word_level(texts: Iterable[str], specials: list[str], unk: str) -> Any:
    """A lower-casing word-level ``tokenizers.Tokenizer`` whose vocabulary is ``specials`` then the words of
    ``texts`` (at most 16,384): a model from scratch needs no pretrained vocabulary."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    backend = Tokenizer(models.WordLevel(unk_token=unk))
    backend.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(
        (t for t in texts if t),
        trainers.WordLevelTrainer(vocab_size=16384, special_tokens=specials, show_progress=False),
    )
    return backend
