"""A transformers decoder split into pipeline stages from its own structure: the modules its ``_pp_plan`` names
(embeddings on the first stage; the decoder layers in consecutive runs; norm and head on the last), balanced by
parameter count. Each rank keeps its stages' modules under their own names, so a stage's state dict holds the
full model's keys for its part: checkpoints of any number of stages load into any other."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from trainer_ext.errors import ConfigError

# decoders whose base model runs embeddings -> rotary positions -> layers -> norm and nothing else, so a stage can
# run its part exactly as the model would
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
ATTENTION = ("sdpa", "eager")


def _parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList | nn.ModuleDict]:
    decoder = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(decoder, "layers", None)
    if decoder is None or layers is None:
        raise ConfigError(f"{type(model).__name__} has no decoder layer list to split into pipeline stages")
    return decoder, layers


def why_not(model: nn.Module, num_stages: int) -> str | None:
    """Why ``model`` cannot be split into ``num_stages`` stages, or None when it can."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED or not getattr(type(model), "_pp_plan", None):
        return (
            f"{name} ({model_type}) is not a decoder the pipeline splits: it splits causal-LM models of "
            f"{', '.join(SUPPORTED)}"
        )
    if getattr(config, "tie_word_embeddings", False):
        return f"{name} ties lm_head to its input embeddings, which the first and last stages hold apart"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"{name} uses sliding-window attention, which the stages do not mask"
    types = set(getattr(config, "layer_types", None) or ())
    if types - {"full_attention"}:
        return f"{name} has {', '.join(sorted(types - {'full_attention'}))} layers, which the stages do not mask"
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in ATTENTION:
        return f"{name} uses {attention} attention; the stages run {' or '.join(ATTENTION)}"
    layers = getattr(config, "num_hidden_layers", 0)
    if layers < num_stages:
        return f"{name} has {layers} decoder layers, fewer than the {num_stages} pipeline stages"
    return None


def check_model(model: nn.Module, num_stages: int) -> None:
    """ConfigError in one line when ``model`` cannot be split into ``num_stages`` stages."""
    reason = why_not(model, num_stages)
    if reason is not None:
        raise ConfigError(f"pipeline parallelism: {reason}; set pp_size=1 (or untie/change the model)")


def _count(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def balance(weights: Sequence[int], first: int, last: int, num_stages: int) -> list[tuple[int, int]]:
    """Consecutive layer ranges ``[start, end)`` for ``num_stages`` stages, each at least one layer, minimising the
    largest stage's parameters; ``first``/``last`` are the parameters the first and last stages carry besides."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[s][i]: the smallest largest-stage cost splitting layers [0, i) into s stages; cut[s][i]: its last start
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                cost = prefix[i] - prefix[j] + (first if s == 1 else 0) + (last if s == num_stages else 0)
                value = max(best[s - 1][j], cost)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    ranges, end = [], n
    for s in range(num_stages, 0, -1):
        start = cut[s][end]
        ranges.append((start, end))
        end = start
    return ranges[::-1]


def layer_ranges(model: nn.Module, num_stages: int, split: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Each stage's decoder layers ``[start, end)``: balanced by parameter count, or cut before each layer index in
    ``split`` (``num_stages − 1`` increasing indices)."""
    decoder, layers = _parts(model)
    count = len(layers)
    if split is not None:
        cuts = list(split)
        if len(cuts) != num_stages - 1 or cuts != sorted(set(cuts)) or not all(0 < c < count for c in cuts):
            raise ConfigError(
                f"pp_split {cuts} must be {num_stages - 1} increasing layer indices between 1 and {count - 1} (the "
                f"first layer of each of the {num_stages} stages after the first)"
            )
        bounds = [0, *cuts, count]
        return list(zip(bounds[:-1], bounds[1:], strict=True))
    weights = (
        [_count(layer) for layer in layers.values()]
        if isinstance(layers, nn.ModuleDict)
        else [_count(layer) for layer in layers]
    )
    head = getattr(model, "lm_head", None)
    return balance(weights, _count(decoder.embed_tokens), _count(decoder.norm) + _count(head), num_stages)


def prune(model: nn.Module, ranges: list[tuple[int, int]], stages: list[int]) -> None:
    """Keep in ``model`` only what ``stages`` run: their layers (a dict keyed by layer number, so names stay the
    full model's), the embeddings on stage 0, norm and head on the last stage."""
    decoder, layers = _parts(model)
    keep = {i for s in stages for i in range(*ranges[s])}
    items = layers.items() if isinstance(layers, nn.ModuleDict) else ((str(i), m) for i, m in enumerate(layers))
    decoder.layers = nn.ModuleDict({k: m for k, m in items if int(k) in keep})
    if 0 not in stages:
        decoder.embed_tokens = None
    if len(ranges) - 1 not in stages:
        decoder.norm = None
        model.lm_head = None


def causal_mask(hidden: torch.Tensor, attention_mask: torch.Tensor | None, attention: str) -> torch.Tensor | None:
    """The mask the decoder layers take: None for SDPA without padding (its causal kernel, as transformers), else
    causal and key padding, boolean for SDPA and additive for eager; a query with no key keeps its own position."""
    if attention == "sdpa" and (attention_mask is None or bool(attention_mask.all())):
        return None
    rows, length = hidden.shape[:2]
    allowed = torch.ones(length, length, dtype=torch.bool, device=hidden.device).tril()[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]
        allowed = allowed | (
            ~allowed.any(-1, keepdim=True) & torch.eye(length, dtype=torch.bool, device=hidden.device)
        )
    allowed = allowed.expand(rows, 1, length, length)
    if attention == "sdpa":
        return allowed
    zero = torch.zeros((), dtype=hidden.dtype, device=hidden.device)
    return zero.masked_fill(~allowed, torch.finfo(hidden.dtype).min)


class StageModule(nn.Module):
    """One stage's run of the model: token ids (first stage) or the previous stage's hidden states in, hidden
    states (or the logits, last stage) out. It holds the model's own modules, so their weights are shared."""

    def __init__(self, model: nn.Module, layer_range: tuple[int, int], first: bool, last: bool) -> None:
        super().__init__()
        decoder, layers = _parts(model)
        self.embed_tokens = decoder.embed_tokens if first else None
        self.layers = nn.ModuleList([layers[str(i)] for i in range(*layer_range)])
        self.norm = decoder.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary_emb = decoder.rotary_emb
        self.attention = getattr(model.config, "_attn_implementation", None) or "eager"

    def forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device)[None].expand(hidden.shape[0], -1)
        mask = causal_mask(hidden, attention_mask, self.attention)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            out = layer(
                hidden, attention_mask=mask, position_embeddings=position_embeddings, position_ids=position_ids
            )
            hidden = out[0] if isinstance(out, tuple) else out
        if self.lm_head is not None:
            hidden = self.lm_head(self.norm(hidden))
        return hidden


def stage_modules(model: nn.Module, ranges: list[tuple[int, int]], stages: list[int]) -> list[StageModule]:
    """The runnable stages of ``stages`` over the (pruned) ``model``."""
    last = len(ranges) - 1
    return [StageModule(model, ranges[s], s == 0, s == last) for s in stages]


def full_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Every state-dict name and shape of the whole model (before pruning): what a checkpoint of it holds."""
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def describe(ranges: list[tuple[int, int]]) -> str:
    """The split in one phrase, e.g. ``layers 0-3 | 4-7``."""
    return "layers " + " | ".join(f"{a}-{b - 1}" for a, b in ranges)


def split_of(model: Any) -> Any:
    """The pipeline runtime a prepared model carries, or None."""
    return getattr(model, "_trainer_ext_pipeline", None)
