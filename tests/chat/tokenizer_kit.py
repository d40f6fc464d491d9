"""Real tokenizers for the chat tests, built here (no hub): word-level as the job builds one, and byte-level BPE."""

from __future__ import annotations

from collections.abc import Iterable

import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from trainer_ext.chat.templates import template_tokens

BASE = {"pad": "[PAD]", "unk": "[UNK]", "bos": "[BOS]", "eos": "[EOS]"}


def word_level(texts: Iterable[str], template: str | None = "chatml", post_process: bool = False):
    """A word-level tokenizer like trainer_ext.job.run.build_tokenizer's, with the template's tokens as specials.

    ``post_process``: add [BOS] ... [EOS] around plain text, as the job's tokenizer does.
    """
    from tokenizers import processors

    specials = list(BASE.values()) + template_tokens(template)
    backend = Tokenizer(models.WordLevel(unk_token=BASE["unk"]))
    backend.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    words = list(texts) + ["system user assistant tool ipython"]
    backend.train_from_iterator(
        words, trainers.WordLevelTrainer(vocab_size=4096, special_tokens=specials, show_progress=False)
    )
    if post_process:
        backend.post_processor = processors.TemplateProcessing(
            single="[BOS] $A [EOS]",
            special_tokens=[("[BOS]", backend.token_to_id("[BOS]")), ("[EOS]", backend.token_to_id("[EOS]"))],
        )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        extra_special_tokens=template_tokens(template),
        **{f"{role}_token": token for role, token in BASE.items()},
    )


def byte_bpe(texts: Iterable[str], template: str | None = "chatml"):
    """A byte-level BPE trained on ``texts``: spaces and newlines are tokens, words merge with their space."""
    specials = list(BASE.values()) + template_tokens(template)
    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        list(texts),
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        extra_special_tokens=template_tokens(template),
        **{f"{role}_token": token for role, token in BASE.items()},
    )
