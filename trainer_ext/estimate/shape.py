"""The numbers of a model that memory depends on, read from the model itself (meta device: nothing allocated)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


def _first(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts (each shared tensor once: a tied embedding/lm_head counts once) and the sizes the
    activation formula needs."""

    model_type: str
    params: int
    trainable: int
    layer_params: int  # parameters of one repeated block (the unit FSDP2/ZeRO-3 gather at a time)
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    causal_lm: bool
    attn_implementation: str = "sdpa"
    factored_trainable: int = 0  # Adafactor's state elements: rows + columns per trainable matrix, numel per vector
    blocks_params: int = 0  # parameters of all the repeated blocks together (0: num_layers x layer_params)
    # parameters the model's own tensor-parallel plan splits (weights of its colwise/rowwise linears and sharded
    # embeddings, biases of colwise ones): all, trainable, and those of the largest repeated block
    tp_params: int = 0
    tp_trainable: int = 0
    tp_layer_params: int = 0
    # DPO's frozen reference model beside it: the bytes of its weights, held whole (never sharded) on every rank
    reference_bytes: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // max(self.heads, 1)

    def tp_local(self, count: int, split: int, tp_size: int) -> float:
        """Elements one tensor-parallel rank holds of ``count``, of which ``split`` the plan divides by ``tp_size``."""
        return count - split + split / max(tp_size, 1)

    @property
    def outer_params(self) -> int:
        """Parameters outside the repeated blocks (embeddings, final norm, head): FSDP2's root unit."""
        return max(self.params - (self.blocks_params or self.num_layers * self.layer_params), 0)

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ModelShape:
        """Read a (meta-device or real) transformers model."""
        config = model.config
        unique = {id(p): p for p in model.parameters()}.values()
        params = sum(_numel(p) for p in unique)
        trainable = sum(_numel(p) for p in unique if p.requires_grad)
        factored = sum(_factored(p) for p in unique if p.requires_grad)
        configured = _first(config, "num_hidden_layers", "n_layer", "num_layers")
        layers = repeated_blocks(model, configured)
        sizes = [sum(_numel(p) for p in block.parameters()) for block in layers]
        hidden = _first(config, "hidden_size", "n_embd", "d_model", default=0)
        heads = _first(config, "num_attention_heads", "n_head", default=1)
        architectures = type(model).__name__
        split = tp_split_parameters(model)
        largest = max(layers, key=lambda block: sum(_numel(p) for p in block.parameters()), default=None)
        block_ids = {id(p) for p in largest.parameters()} if largest is not None else set()
        return cls(
            model_type=str(getattr(config, "model_type", "unknown")),
            params=params,
            trainable=trainable,
            layer_params=max(sizes, default=0),
            blocks_params=sum(sizes),
            num_layers=len(layers) or (configured if isinstance(configured, int) and configured > 0 else 0),
            hidden=hidden,
            intermediate=_first(config, "intermediate_size", "n_inner", "ffn_dim", default=None) or 4 * hidden,
            heads=heads,
            kv_heads=_first(config, "num_key_value_heads", default=heads) or heads,
            vocab=_first(config, "vocab_size", default=0),
            causal_lm=architectures.endswith(("ForCausalLM", "LMHeadModel")),
            attn_implementation=str(getattr(config, "_attn_implementation", None) or "sdpa"),
            factored_trainable=factored,
            tp_params=sum(_numel(p) for p in split),
            tp_trainable=sum(_numel(p) for p in split if p.requires_grad),
            tp_layer_params=sum(_numel(p) for p in split if id(p) in block_ids),
        )


def tp_split_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters (each once) the model's own tensor-parallel plan splits: every weight of a module it shards,
    the bias of a colwise one (a rowwise bias is replicated); none without a plan."""
    from trainer_ext.distributed.mesh.tensor_parallel import STYLES, model_tp_plan, resolve_plan

    try:
        resolved = resolve_plan(model, model_tp_plan(model), strict=False)
    except ValueError:  # a style the mesh module does not apply: training refuses it; nothing split here
        return []
    found: dict[int, torch.nn.Parameter] = {}
    for name, style in resolved.items():
        kind = STYLES[style][0]
        if not kind:
            continue
        module = model.get_submodule(name)
        for attr, param in module.named_parameters(recurse=False):
            if attr == "weight" or kind == "colwise":
                found[id(param)] = param
    return list(found.values())


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters in their own dtypes (a meta model's too), each shared tensor once."""
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(_numel(p) * p.element_size() for p in unique)


def _numel(p: torch.nn.Parameter) -> int:
    """Elements of a parameter; under ZeRO-3 the model is already partitioned (``numel()`` 0), ``ds_numel`` is
    the full count."""
    return int(getattr(p, "ds_numel", None) or p.numel())


def _factored(p: torch.nn.Parameter) -> int:
    """Adafactor's second-moment elements for ``p``: a row and a column vector for a matrix, the whole of a vector."""
    shape = tuple(getattr(p, "ds_shape", None) or p.shape)
    if len(shape) < 2:
        return _numel(p)
    leading = math.prod(shape[:-2])
    return leading * shape[-2] + leading * shape[-1]  # exp_avg_sq_row (shape[:-1]) + exp_avg_sq_col


def repeated_blocks(model: torch.nn.Module, configured: int | None = None) -> list[torch.nn.Module]:
    """The model's repeated layers (the units FSDP2/ZeRO-3 gather one at a time), chosen by count and structure.

    Candidates are the outermost ModuleLists whose entries are all of one class (a block's own inner lists are not
    candidates); the one holding ``configured`` (the config's layer count) entries wins, a ``_no_split_modules``
    class and then the larger block breaking ties; without one, a ``_no_split_modules`` list, then the longest.
    ``configured`` 0: none. A class named in ``_no_split_modules`` but occurring once (BERT's embeddings) is never the layer."""
    if not isinstance(configured, int) or isinstance(configured, bool):
        configured = None
    elif configured <= 0:
        return []
    lists = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1
    }
    outermost = [module for name, module in lists.items() if not any(name.startswith(f"{other}.") for other in lists)]
    if not outermost:
        return []
    unsplit = set(getattr(model, "_no_split_modules", None) or ())

    def rank(blocks: torch.nn.ModuleList) -> tuple[bool, bool, int, int]:
        size = sum(_numel(p) for p in blocks[0].parameters())
        return len(blocks) == configured, type(blocks[0]).__name__ in unsplit, len(blocks), size

    return list(max(outermost, key=rank))
