"""Tensor parallelism from a model's own plan: transformers' style names (``base_model_tp_plan``, the class
``_tp_plan``, or a user dict) mapped onto torch's ``parallelize_module`` styles over a 1-D ``tp`` mesh."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trainer_ext.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

GRAD_SUMMED = "replicated_with_grad_allreduce"
# transformers' style name -> (torch style, its input layout, its output layout, the kind of module it shards)
#   colwise: the output features split over the ranks, the output left sharded (the next rowwise takes it)
#   colwise_rep / colwise_gather_output: the same weights, the output gathered whole (a model's lm_head)
#   rowwise: the input features split, the partial outputs summed; rowwise_rep / rowwise_split_input: the input
#   arrives whole and is split first; embedding_rowwise: the vocabulary split (transformers 5.x shards
#   embed_tokens so); embedding_colwise: the hidden size split; replicate: every rank keeps the whole module
STYLES: dict[str, tuple[str, str, str, str]] = {
    "colwise": ("colwise", "replicate", "shard", "linear"),
    "colwise_rep": ("colwise", "replicate", "replicate", "linear"),
    "colwise_gather_output": ("colwise", "replicate", "replicate", "linear"),
    "rowwise": ("rowwise", "shard", "replicate", "linear"),
    "rowwise_rep": ("rowwise", "replicate", "replicate", "linear"),
    "rowwise_split_input": ("rowwise", "replicate", "replicate", "linear"),
    "embedding_rowwise": ("rowwise", "replicate", "replicate", "embedding"),
    "embedding_colwise": ("colwise", "replicate", "replicate", "embedding"),
    "replicate": ("", "", "", "any"),
    # whole on every rank, fed a head-split activation (a Qwen3/Gemma3 q_norm): its gradient is summed over tp
    GRAD_SUMMED: ("", "", "", "any"),
}

# configuration sizes that the plan splits over the tp ranks, and the plan entries that split them
SPLIT_SIZES = (
    ("num_attention_heads", ("q_proj", "qkv_proj", "query_key_value", "o_proj")),
    ("num_key_value_heads", ("k_proj", "v_proj", "qkv_proj", "query_key_value")),
    ("intermediate_size", ("gate_proj", "up_proj", "down_proj", "gate_up_proj")),
)


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether the model is sharded already: loaded tensor-parallel by transformers, or holding DTensor parameters."""
    from torch.distributed.tensor import DTensor

    tp_size = getattr(model, "tp_size", None)
    if isinstance(tp_size, int) and tp_size > 1:
        return True
    return any(isinstance(p, DTensor) for p in model.parameters())


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's own plan with names from the root: its class ``_tp_plan`` (e.g. ``lm_head``) and its config's
    ``base_model_tp_plan`` under the base model's attribute (``model.layers.*…``); transformers 5.x's merged
    instance plan (which also names ``embed_tokens``) wins where the instance carries one."""
    instance = model.__dict__.get("_tp_plan")
    if isinstance(instance, dict) and instance:
        return dict(instance)
    plan = dict(getattr(type(model), "_tp_plan", None) or {})
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, "base_model", model)
    inner = prefix if prefix and base is not model and getattr(model, prefix, None) is base else ""
    plan.update({f"{inner}.{key}" if inner else key: style for key, style in base_plan.items()})
    return plan


def check_styles(plan: dict[str, str]) -> None:
    """Refuse a style this module does not map, in one line naming it and its entry."""
    for name, style in plan.items():
        if style not in STYLES:
            known = ", ".join(sorted(STYLES))
            raise ConfigError(
                f"tensor-parallel plan entry {name!r} asks for style {style!r}, which trainer_ext does not apply: "
                f"use one of {known}, or leave tp_size at 1 for this model"
            )


def resolve_plan(model: nn.Module, plan: dict[str, str], *, strict: bool) -> dict[str, str]:
    """Plan keys (``*`` for a layer number) matched to the model's module names: {module name: style}. With
    ``strict`` (a user's plan) an entry that matches no module is refused."""
    check_styles(plan)
    patterns = [(re.compile(_pattern(key)), key, style) for key, style in plan.items()]
    resolved: dict[str, str] = {}
    used: set[str] = set()
    for name, _ in model.named_modules():
        for pattern, key, style in patterns:
            if name and pattern.fullmatch(name):
                resolved[name] = style
                used.add(key)
                break
    unused = [key for key in plan if key not in used]
    if strict and unused:
        raise ConfigError(
            f"tensor-parallel plan entry {unused[0]!r} names no module of {type(model).__name__}: "
            f"give module names as model.named_modules() spells them, '*' for a layer number"
        )
    return resolved


def _pattern(key: str) -> str:
    return r"\.".join(r"\d+" if part == "*" else re.escape(part) for part in key.split("."))


def check_split_sizes(
    values: Mapping[str, Any] | Any,
    plan: Mapping[str, str],
    tp_size: int,
    *,
    where: str = "",
    extra: tuple[tuple[str, tuple[str, ...]], ...] = (),
) -> None:
    """Refuse a configuration size (heads, key/value heads, intermediate size; ``extra`` ones too) that the modules
    ``plan`` splits cannot divide over ``tp_size`` ranks. ``values``: a config object or a dict of its fields;
    ``where`` follows the size in the message (e.g. `` of the preset tiny-llama``)."""
    read = values.get if isinstance(values, Mapping) else lambda name: getattr(values, name, None)
    leaves = {name.rsplit(".", 1)[-1] for name, style in plan.items() if style not in ("replicate", GRAD_SUMMED)}
    for field, users in (*SPLIT_SIZES, *extra):
        size = read(field)
        if field == "num_key_value_heads" and size is None:
            size = read("num_attention_heads")
        if isinstance(size, int) and leaves.intersection(users) and size % tp_size:
            raise ConfigError(
                f"tensor parallelism over {tp_size} ranks needs {field} ({size}){where} divisible by {tp_size}: "
                f"choose a tp_size that divides {size}"
            )


def check_divisible(
    model: nn.Module, resolved: dict[str, str], tp_size: int, *, planned: dict[str, str] | None = None
) -> None:
    """Refuse, before any sharding, a configuration size or a module width the tp ranks cannot split evenly;
    ``planned`` (default ``resolved``) names the modules as the model's plan does, for the configuration sizes."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    check_split_sizes(config, resolved if planned is None else planned, tp_size)
    modules = dict(model.named_modules())
    for name, style in resolved.items():
        torch_style, _, _, kind = STYLES[style]
        width_name, width = _split_width(modules[name], torch_style, kind)
        if width_name is None:
            raise ConfigError(
                f"tensor-parallel style {style!r} on {name!r} needs an nn.{kind.capitalize()}, "
                f"not {type(modules[name]).__name__}: fix the plan entry"
            )
        if width is not None and width % tp_size:
            raise ConfigError(
                f"tensor parallelism over {tp_size} ranks needs {name}.{width_name} ({width}) divisible by "
                f"{tp_size}: choose a tp_size that divides {width}"
            )


def _split_width(module: nn.Module, torch_style: str, kind: str) -> tuple[str | None, int | None]:
    """(the attribute holding the split width, its value); (None, None) when the module is not the kind asked."""
    from torch import nn

    if kind == "any":
        return "", None
    if kind == "linear":
        if not isinstance(module, nn.Linear):
            return None, None
        return (
            ("out_features", module.out_features) if torch_style == "colwise" else ("in_features", module.in_features)
        )
    if not isinstance(module, nn.Embedding):
        return None, None
    if torch_style == "rowwise":
        return "num_embeddings", module.num_embeddings
    return "embedding_dim", module.embedding_dim


def torch_style(style: str) -> ParallelStyle | None:
    """torch's ``ParallelStyle`` for a transformers style name (None for ``replicate``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    kind, input_layout, output_layout, _ = STYLES[style]
    if not kind:
        return None
    layouts: dict[str, Any] = {"replicate": Replicate(), "shard": Shard(-1)}
    cls = ColwiseParallel if kind == "colwise" else RowwiseParallel
    return cls(input_layouts=layouts[input_layout], output_layouts=layouts[output_layout])


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str] | None = None) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` by ``plan`` (default: the model's own) and return it; a
    model already tensor-parallel, or a mesh of one rank, is returned as it is."""
    from torch.distributed.tensor.parallel import parallelize_module

    if tp_mesh.ndim != 1:
        raise ConfigError(f"tensor parallelism takes a 1-D mesh (the 'tp' view), got {tp_mesh.ndim} dimensions")
    tp_size = tp_mesh.size()
    if tp_size == 1 or is_tensor_parallel(model):
        return model
    # a PEFT model: the plan names the base model's modules (the same objects, under its own names)
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    own = plan is None
    plan = model_tp_plan(base) if own else dict(plan)
    if not plan:
        raise ConfigError(
            f"{type(base).__name__} has no tensor-parallel plan (config.base_model_tp_plan is empty): "
            f"pass a plan dict, or leave tp_size at 1"
        )
    planned = resolve_plan(base, plan, strict=not own)
    resolved = with_adapters(base, planned)
    check_divisible(base, resolved, tp_size, planned=planned)
    ties = _tied_parameters(base, resolved)
    styles = {name: s for name, style in resolved.items() if (s := torch_style(style)) is not None}
    parallelize_module(base, tp_mesh, styles)
    _retie(base, ties)
    replicate_rest(base, tp_mesh, split_inputs={name for name, style in resolved.items() if style == GRAD_SUMMED})
    return model


def replicate_rest(model: nn.Module, tp_mesh: DeviceMesh, split_inputs: set[str] = frozenset()) -> None:
    """Make the parameters the plan left plain (norms, LoRA's unsplit factors) replicated DTensors on ``tp_mesh``,
    their modules taking and giving plain tensors: every parameter is then a DTensor, which foreach/fused optimizers
    and gradient clipping need (they refuse lists mixing tensors and DTensors). Leaf modules only. The modules named
    in ``split_inputs`` read activations split by heads (dimension -2): their gradients are summed over the ranks."""
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate

    for name, module in model.named_modules():
        own = [(key, p) for key, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        if not own or next(module.children(), None) is not None:
            continue
        for key, param in own:
            replicated = DTensor.from_local(param.data, tp_mesh, [Replicate()], run_check=False)
            module.register_parameter(key, nn.Parameter(replicated, requires_grad=param.requires_grad))
        module.register_forward_pre_hook(_inputs_to_dtensor(tp_mesh, split=name in split_inputs), with_kwargs=True)
        module.register_forward_hook(_outputs_to_local)


def _inputs_to_dtensor(tp_mesh: DeviceMesh, *, split: bool) -> Any:
    """Inputs as DTensors: replicated, or (``split``) sharded on dimension -2, so that the weight's gradient is a
    partial sum over the ranks, which DTensor adds up."""
    from torch import Tensor
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def convert(value: Any) -> Any:
        if isinstance(value, Tensor) and not isinstance(value, DTensor):
            placement = Shard(value.ndim - 2) if split and value.ndim >= 2 else Replicate()
            return DTensor.from_local(value, tp_mesh, [placement], run_check=False)
        return value

    def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}

    return hook


def _outputs_to_local(_: nn.Module, __: Any, output: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(output, DTensor):
        return output.to_local()
    if isinstance(output, tuple | list):
        return type(output)(o.to_local() if isinstance(o, DTensor) else o for o in output)
    return output


def with_adapters(model: nn.Module, resolved: dict[str, str]) -> dict[str, str]:
    """The plan with each LoRA-wrapped module (PEFT's ``base_layer`` + ``lora_A``/``lora_B``) split into its parts:
    the base layer takes the style; a column-split one's ``lora_B`` splits its output the same way, a row-split
    one's ``lora_A`` its input (the other factor, of rank r, stays whole on every rank)."""
    from torch import nn

    out: dict[str, str] = {}
    for name, style in resolved.items():
        module = model.get_submodule(name)
        base = getattr(module, "base_layer", None)
        if not isinstance(base, nn.Module) or style == "replicate":
            out[name] = style
            continue
        factors = {part: getattr(module, part, None) for part in ("lora_A", "lora_B")}
        magnitude = getattr(module, "lora_magnitude_vector", None)
        if (
            STYLES[style][3] != "linear"
            or not all(isinstance(f, nn.ModuleDict) for f in factors.values())
            or magnitude
        ):
            raise ConfigError(
                f"{name} carries an adapter ({type(module).__name__}) that tensor parallelism cannot split: "
                "LoRA on Linear layers is supported (no DoRA, no embeddings); leave this module out of "
                "target_modules, or tp_size at 1"
            )
        out[f"{name}.base_layer"] = style
        split = "lora_B" if STYLES[style][0] == "colwise" else "lora_A"
        out.update({f"{name}.{split}.{key}": style for key in factors[split]})
    return out


def _tied_parameters(model: nn.Module, resolved: dict[str, str]) -> list[list[str]]:
    """Groups of parameter names that share one tensor and touch a sharded module (a tied lm_head)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    sharded = [name for name, style in resolved.items() if style != "replicate"]
    return [
        names for names in groups.values() if len(names) > 1 and any(n.rpartition(".")[0] in sharded for n in names)
    ]


def _retie(model: nn.Module, ties: list[list[str]]) -> None:
    """Make tied parameters one tensor again after sharding, or refuse when their layouts differ."""
    from torch.distributed.tensor import DTensor

    for names in ties:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            other = model.get_parameter(name)
            same = getattr(first, "placements", None) == getattr(other, "placements", None)
            if not same or isinstance(first, DTensor) != isinstance(other, DTensor):
                raise ConfigError(
                    f"tied parameters {names[0]!r} and {name!r} would be sharded differently by the plan: "
                    f"give both modules the same style, or untie them (tie_word_embeddings=False)"
                )
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)
