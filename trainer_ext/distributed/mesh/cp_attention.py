"""The attention a context-parallel model runs, registered with transformers' ``AttentionInterface`` (and its mask
interface) under one name. Outside a context-parallel region it is SDPA with transformers' own mask; inside one:

- ``all_gather``: the ``cp`` ranks' keys and values are all-gathered with autograd and put in global order; each run
  of consecutive local queries attends to the prefix of keys up to its last query (so the load-balanced split gives
  every rank the same work) under one additive mask per forward, shared by every layer: causal, within one document
  (``position_ids`` resets, as in packed batches) and over unpadded keys (the 2-D ``attention_mask``, gathered too);
- ``torch``: SDPA with ``is_causal=True``, which torch's ``context_parallel`` turns into ring attention.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from trainer_ext.distributed.mesh.context_parallel import Active, active
from trainer_ext.errors import ConfigError

NAME = "trainer_ext_context_parallel"
_RAN_IN_REGION = "_trainer_ext_cp_forward"  # set on an attention module at each forward outside backward


def _gather(tensor: torch.Tensor, region: Active) -> torch.Tensor:
    """Every ``cp`` rank's ``tensor`` joined on dim 1 in rank order, without autograd (masks and positions)."""
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(region.split.cp_size)]
    dist.all_gather(parts, tensor.contiguous(), group=region.group)
    return torch.cat(parts, dim=1)


class _GatherSequence(torch.autograd.Function):
    """Every ``cp`` rank's keys or values joined on the sequence dimension (2); the backward sums each slot's
    gradient over the ranks and hands every rank its own slice (gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any, ranks: int, rank: int) -> torch.Tensor:
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(ranks)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        ctx.group, ctx.rank, ctx.length = group, rank, tensor.shape[2]
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(2, ctx.rank * ctx.length, ctx.length), None, None, None


def _gather_with_grad(tensor: torch.Tensor, region: Active) -> torch.Tensor:
    return _GatherSequence.apply(tensor, region.group, region.split.cp_size, region.rank)


def _check_positions(position_ids: torch.Tensor | None, region: Active) -> None:
    """Refuse positions the model made up for the local slice: rotary embeddings need the sharded global ones."""
    if position_ids is not None:
        positions = position_ids.expand(position_ids.shape[0], -1)
        for buffer in region.buffers:
            if buffer.shape == positions.shape and buffer.dtype == positions.dtype and torch.equal(buffer, positions):
                return
            if buffer.dim() == 1 and positions.shape[0] == 1 and torch.equal(buffer, positions[0]):
                return
    raise ConfigError(
        "context parallelism needs position_ids among the sharded buffers (global positions for the rotary "
        "embeddings): pass position_ids to the model and to maybe_context_parallel's buffers"
    )


def _runs(q_index: torch.Tensor) -> list[tuple[int, int]]:
    """The (start, end) of each run of consecutive global positions in this rank's local order."""
    breaks = (torch.nonzero(q_index[1:] - q_index[:-1] != 1).flatten() + 1).tolist()
    edges = [0, *breaks, q_index.numel()]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _layout(
    region: Active, batch: int, q_length: int, position_ids: Any, key_padding: Any, dtype: torch.dtype, device: Any
) -> dict[str, Any]:
    """What every layer of one forward shares: the permutation of gathered keys into global order, and per run of
    local queries its key prefix and additive mask (causal, one document, unpadded keys); the queries with no key."""
    length = q_length * region.split.cp_size
    q_index = region.split.indices(region.rank, length, device)
    order = torch.argsort(region.split.gathered_indices(length, device))
    positions = _gather(position_ids.expand(batch, -1), region).index_select(1, order)  # global order
    previous = torch.cat([positions[:, :1] - 1, positions[:, :-1]], dim=1)
    document = (positions - previous != 1).cumsum(-1)  # transformers' rule: a new document where positions do not step
    valid = None
    if key_padding is not None:
        valid = _gather(key_padding.to(torch.uint8), region).index_select(1, order).bool()
    runs, some = [], []
    for start, end in _runs(q_index):
        queries = q_index[start:end]
        keys = int(queries[-1]) + 1  # a run attends to the prefix of the sequence up to its last query
        k_index = torch.arange(keys, device=device)
        allowed = (k_index[None, :] <= queries[:, None]) & (document[:, queries, None] == document[:, None, :keys])
        if valid is not None:
            allowed = allowed & valid[:, None, :keys]
        has_key = allowed.any(-1, keepdim=True)
        # a query with no key attends to itself (no NaN row on any kernel), and its output is zeroed after
        allowed = allowed | (~has_key & (k_index[None, :] == queries[:, None]))
        additive = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        runs.append((start, end, keys, additive[:, None]))
        some.append(has_key)
    return {"order": order, "runs": runs, "some": torch.cat(some, dim=1)[:, None]}


def _check_recompute(module: torch.nn.Module, region: Active | None) -> None:
    """Refuse activation checkpointing's recomputation of a layer that ran in a context-parallel region once the
    region has exited: it would attend over this rank's slice alone (wrong gradients, or a shape error)."""
    in_backward = torch._C._current_graph_task_id() != -1
    if region is None and in_backward and module.__dict__.get(_RAN_IN_REGION, False):
        raise ConfigError(
            f"activation checkpointing recomputed {type(module).__name__} after the context-parallel region "
            "exited: call backward inside maybe_context_parallel (as the Trainer does)"
        )
    if not in_backward:
        module.__dict__[_RAN_IN_REGION] = region is not None


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns ([batch, length, heads, head_dim], None)."""
    region = active()
    _check_recompute(module, region)
    if region is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if kwargs.get("sliding_window"):
        raise ConfigError(
            f"context parallelism met a sliding-window layer ({kwargs['sliding_window']} tokens) in "
            f"{type(module).__name__}: it trains full causal attention only; use cp_size=1 for this model"
        )
    groups = query.shape[1] // key.shape[1]
    if region.backend == "torch":
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=True)
        return out.transpose(1, 2).contiguous(), None
    position_ids = kwargs.get("position_ids")
    cached = region.cache.get("layout")
    if cached is None or cached[0] is not position_ids or cached[1] is not attention_mask or cached[2] != query.dtype:
        _check_positions(position_ids, region)
        shape = (query.shape[0], query.shape[2])
        layout = _layout(region, *shape, position_ids, attention_mask, query.dtype, query.device)
        region.cache["layout"] = cached = (position_ids, attention_mask, query.dtype, layout)
    layout = cached[3]
    keys = _gather_with_grad(key, region).index_select(2, layout["order"])  # global order
    values = _gather_with_grad(value, region).index_select(2, layout["order"])
    # key/value heads stay shared (not repeated per query head) where SDPA's CPU kernel takes grouped heads
    grouped = {"enable_gqa": True} if groups > 1 and query.device.type == "cpu" else {}
    if groups > 1 and not grouped:
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, start:end],
            keys[:, :, :prefix],
            values[:, :, :prefix],
            attn_mask=additive,
            dropout_p=dropout,
            scale=scaling,
            **grouped,
        )
        for start, end, prefix, additive in layout["runs"]
    ]
    out = torch.cat(outs, dim=2).masked_fill(~layout["some"], 0.0)  # as SDPA: a query with no key to attend to gives 0
    return out.transpose(1, 2).contiguous(), None


def mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask-function signature: inside a region the 2-D padding mask as it is (the attention builds the
    rest), outside one SDPA's mask."""
    if active() is not None:
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ConfigError(
                f"context parallelism takes a 2-D attention_mask (padding), not {attention_mask.dim()}-D: pass "
                "position_ids resets for packed documents instead of a block mask"
            )
        return attention_mask  # as it is on every rank: the attention gathers it (one collective on all or none)
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Register the attention and mask functions with transformers (idempotent); returns their name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, mask)
    return NAME


def adopt(model: torch.nn.Module) -> None:
    """Make ``model`` (and every sub-model's configuration) run this attention."""
    register()
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    for config in configs.values():
        for sub in [config, *(getattr(config, k, None) for k in getattr(config, "sub_configs", {}) or {})]:
            if sub is not None and hasattr(sub, "_attn_implementation"):
                sub._attn_implementation = NAME
