"""Compare what a scenario observed under stock transformers+accelerate and under trainer_ext.

    python -m tests.parity.compare STOCK.json OURS.json     (exit status 1 on an unexpected difference)

Tolerances (relative): learning rates 1e-9 and epochs 1e-12 (plain Python arithmetic on both sides); every
other float — losses, grad norms, eval metrics, prediction sums — 1e-5; a weight tensor's sum within 1e-5 of its
absolute sum. Values the clock or the allocator decide (``*_runtime``, ``*_per_second``, memory deltas) were
blanked by the scenario: only their keys are compared. Weights that match within tolerance but not bitwise are
reported as a note, not as a difference.

Exceptions: the same type and message are equal. An exception of ours that is an instance of stock's type (stock's
type among ours' MRO names) with a message that starts with stock's message is one "refined exception" difference
(trainer_ext keeps transformers' type and message and adds its own detail), which ``ALLOWED`` accepts; any other
change of type or message is a difference.

Deliberate differences are listed in ``ALLOWED``, each with its reason; everything else is a difference.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.parity_harness.compare import compare_main, is_number, short

DEFAULT_RTOL = 1e-5
# (pattern on the value's path, relative tolerance): the first match wins
TOLERANCES: list[tuple[str, float]] = [
    (r"(^|\.)learning_rate$", 1e-9),
    (r"(^|\.)(scheduler_last_lr)(\[\d+\])?$", 1e-9),
    (r"(^|\.)epoch$", 1e-12),
]
WEIGHTS_RTOL = 1e-5
MAX_ITEMS_SHOWN = 12
SHOWN_CHARS = 300  # of one value in a difference's line


@dataclass(frozen=True)
class Allowed:
    """A deliberate difference: every field but ``reason`` is a pattern (re.search) on a difference.

    ``value`` is matched on the item a difference is about (a list item or key), ``stock`` and ``ours`` on the
    two sides' values (strings as they are, anything else as JSON: ``null``, ``true``, ``3``).
    """

    reason: str
    path: str
    kind: str = ".*"
    value: str = ".*"
    scenario: str = ".*"
    stock: str = ".*"
    ours: str = ".*"

    def matches(self, scenario: str, difference: Difference) -> bool:
        return bool(
            re.search(self.scenario, scenario)
            and re.search(self.path, difference.path)
            and re.search(self.kind, difference.kind)
            and re.search(self.value, difference.item)
            and re.search(self.stock, _text(difference.stock))
            and re.search(self.ours, _text(difference.ours))
        )


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


@dataclass(frozen=True)
class Difference:
    path: str
    kind: str  # "value", "only in stock", "only in ours", "order", "type", "length", "raised only in …", …
    stock: Any = None
    ours: Any = None
    item: str = ""  # the list item or key this is about (what Allowed.value matches)

    def describe(self) -> str:
        if self.kind in ("only in stock", "only in ours", "no result"):
            return f"{self.path}: {self.kind}: {self.item}"
        return (
            f"{self.path}: {self.kind}: stock {short(self.stock, SHOWN_CHARS)} | ours {short(self.ours, SHOWN_CHARS)}"
        )


# The refusals trainer_ext makes when the TrainingArguments are built, where stock fails later inside train()
ARGUMENT_CHECKS = "batch_size_zero|gradient_accumulation_zero|negative_learning_rate"
# trainer_ext's own TrainingArguments fields (to_dict() lists them after transformers' own)
OWN_FIELDS = (
    "fp8",
    "fp16_init_scale",
    "fp16_growth_interval",
    "preemption_grace_seconds",
    "preemption_exit_code",
    "preemption_check_steps",
    "run_summary",
    "save_final_model",
    "exact_eval_loss",
    "save_on_preemption",
)


def misconfiguration(mistakes: str, paths: str = "outcome|raised_at", **fields: str) -> Allowed:
    """A deliberate difference in the ``misconfigurations`` scenario, about the ``paths`` (a pattern on the rest of
    the path: by default where it raised and its outcome) below the mistakes that ``mistakes`` names (a pattern)."""
    return Allowed(path=rf"^({mistakes})\.({paths})$", scenario=r"^misconfigurations$", **fields)


ALLOWED: list[Allowed] = [
    Allowed(
        reason="trainer_ext commits every checkpoint folder with a COMPLETE marker, so a partial checkpoint is "
        "never resumed",
        path=r"(^|\.)files(_\w+)?$|files_by_folder",
        kind="only in (ours|stock)",  # stock's side has them where it resumed a run that trainer_ext began
        value=r"(^|/)COMPLETE$",
    ),
    Allowed(
        reason="trainer_ext raises transformers' exception type (ConfigError is a ValueError) with transformers' "
        "message first, then its own detail",
        path=r"(^|\.)error$",
        kind=r"^refined exception$",
    ),
    misconfiguration(
        ARGUMENT_CHECKS,
        r"raised_at|outcome\.error\.(type|message)",
        reason="trainer_ext refuses batch size 0, gradient_accumulation_steps=0 and a negative learning rate when "
        "the TrainingArguments are built (ConfigError, a ValueError, before anything is written); stock fails "
        "later inside train()",
        kind=r"^(value|exception type.*)$",
        ours=r"^(arguments|ConfigError)$|^--(per_device_train_batch_size|gradient_accumulation_steps|learning_rate) ",
    ),
    misconfiguration(
        "fp16_on_cpu",
        reason="trainer_ext refuses fp16=True on the CPU (fp16 autocast needs CUDA); stock silently trains in fp32",
        kind=r"^(raised only in ours|type)$",
        ours=r"^(ConfigError: fp16 |arguments$)",
    ),
    misconfiguration(
        "bf16_without_use_cpu",
        reason="without a GPU, trainer_ext trains bf16=True on the CPU even without use_cpu; stock raises",
        kind=r"^(raised only in stock|type)$",
        ours=r"^(\(no exception\)|null)$",
    ),
    Allowed(
        reason="a forward(**kwargs) model that ignores num_items_in_batch: transformers skips the division by "
        "gradient_accumulation_steps (loss that many times too large); trainer_ext sees the loss does not use "
        "num_items_in_batch and averages per micro-batch (the big-batch loss)",
        scenario=r"^gradient_accumulation_kwargs_model$",
        path=r"^(log_history\[\d+\]\.(loss|grad_norm|train_loss)|train\.(training_loss|metrics\.train_loss)"
        r"|model_accepts_loss_kwargs|weights\.tensors\.[\w.]+\.(sum|abs_sum))$",
        kind=r"^value$",
    ),
    Allowed(
        reason="trainer_ext's own TrainingArguments fields appear in to_dict()",
        scenario=r"^arguments_surface$",
        path=r"^to_dict_keys$",
        kind=r"^only in ours$",
        value="^(" + "|".join(OWN_FIELDS) + ")$",
    ),
    Allowed(
        reason="training_args.bin holds trainer_ext's TrainingArguments, a subclass of transformers' (as TRL's "
        "configs are)",
        path=r"(^|\.)(checkpoint-\d+_)?training_args_bin$",
        kind=r"^value$",
        stock=r"^transformers\.training_args\.TrainingArguments$",
        ours=r"^trainer_ext\.trainer\.training_args\.TrainingArguments$",
    ),
]


def tolerance(path: str) -> float:
    for pattern, rtol in TOLERANCES:
        if re.search(pattern, path):
            return rtol
    return DEFAULT_RTOL


def close(a: float, b: float, rtol: float, atol: float = 0.0) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=atol)


class Comparison:
    """Walks two results side by side and collects their differences and notes."""

    def __init__(self) -> None:
        self.differences: list[Difference] = []
        self.notes: list[str] = []

    def add(self, difference: Difference) -> None:
        self.differences.append(difference)

    def walk(self, path: str, stock: Any, ours: Any) -> None:
        if _is_error(stock) or _is_error(ours):
            self.errors(path, stock, ours)
        elif isinstance(stock, dict) and isinstance(ours, dict):
            if _is_weights(stock) and _is_weights(ours):
                self.weights(path, stock, ours)
            else:
                self.mapping(path, stock, ours)
        elif isinstance(stock, list) and isinstance(ours, list):
            self.sequence(path, stock, ours)
        elif is_number(stock) and is_number(ours):
            if isinstance(stock, int) and isinstance(ours, int):
                if stock != ours:
                    self.add(Difference(path, "value", stock, ours))
            elif not close(float(stock), float(ours), tolerance(path)):
                self.add(Difference(path, "value", stock, ours))
        elif type(stock) is not type(ours):
            self.add(Difference(path, "type", stock, ours))
        elif stock != ours:
            self.add(Difference(path, "value", stock, ours))

    def mapping(self, path: str, stock: dict, ours: dict) -> None:
        for key in sorted(set(stock) | set(ours)):
            child = f"{path}.{key}" if path else key
            if key not in ours:
                self.add(Difference(path or ".", "only in stock", stock[key], None, key))
            elif key not in stock:
                self.add(Difference(path or ".", "only in ours", None, ours[key], key))
            else:
                self.walk(child, stock[key], ours[key])

    def sequence(self, path: str, stock: list, ours: list) -> None:
        if all(isinstance(v, str) for v in stock + ours) and (stock or ours):
            self.names(path, stock, ours)
            return
        if len(stock) != len(ours):
            self.add(Difference(path, "length", len(stock), len(ours)))
        for i, (a, b) in enumerate(zip(stock, ours, strict=False)):
            self.walk(f"{path}[{i}]", a, b)

    def names(self, path: str, stock: list[str], ours: list[str]) -> None:
        """Lists of names (files, callbacks, keys): what one side has and the other not, then the order."""
        only_stock = [v for v in stock if v not in ours]
        only_ours = [v for v in ours if v not in stock]
        for value in only_stock:
            self.add(Difference(path, "only in stock", item=value))
        for value in only_ours:
            self.add(Difference(path, "only in ours", item=value))
        common_stock = [v for v in stock if v in ours]
        common_ours = [v for v in ours if v in stock]
        if common_stock != common_ours:
            self.add(Difference(path, "order", common_stock, common_ours))

    def errors(self, path: str, stock: Any, ours: Any) -> None:
        """An exception on one side only, or different exceptions (type, or message)."""
        if not (_is_error(stock) and _is_error(ours)):
            raised = "ours" if _is_error(ours) else "stock"
            error = (ours if raised == "ours" else stock)["error"]
            summary = f"{error['type']}: {error['message']}"
            self.add(
                Difference(
                    path or ".",
                    f"raised only in {raised}",
                    summary if raised == "stock" else "(no exception)",
                    summary if raised == "ours" else "(no exception)",
                    item=summary,
                )
            )
            return
        a, b = stock["error"], ours["error"]
        if a["type"] == b["type"] and a["message"] == b["message"]:
            return
        if refines(a, b):
            summaries = (f"{e['type']}: {e['message']}" for e in (a, b))
            self.add(Difference(f"{path}.error", "refined exception", *summaries))
            return
        if a["type"] != b["type"]:
            kind = "exception type (ours subclasses stock's)" if a["type"] in b["bases"] else "exception type"
            self.add(Difference(f"{path}.error.type", kind, a["type"], b["type"]))
        if a["message"] != b["message"]:
            self.add(Difference(f"{path}.error.message", "value", a["message"], b["message"]))

    def weights(self, path: str, stock: dict, ours: dict) -> None:
        a, b = stock["tensors"], ours["tensors"]
        self.names(f"{path}.tensors", list(a), list(b))
        worst, before = 0.0, len(self.differences)
        for name in sorted(set(a) & set(b)):
            ta, tb = a[name], b[name]
            if ta["shape"] != tb["shape"] or ta["dtype"] != tb["dtype"]:
                self.add(Difference(f"{path}.tensors.{name}", "shape/dtype", ta, tb))
                continue
            for key in ("sum", "abs_sum"):
                x, y = ta[key], tb[key]
                if not (is_number(x) and is_number(y)):
                    if x != y:
                        self.add(Difference(f"{path}.tensors.{name}.{key}", "value", x, y))
                    continue
                scale = max(abs(ta["abs_sum"]), abs(tb["abs_sum"])) if is_number(ta["abs_sum"]) else 0.0
                if abs(x - y) > WEIGHTS_RTOL * scale:
                    self.add(Difference(f"{path}.tensors.{name}.{key}", "value", x, y))
                elif scale:
                    worst = max(worst, abs(x - y) / scale)
        if stock["sha256"] != ours["sha256"] and len(self.differences) == before:
            self.notes.append(f"{path or 'weights'}: within tolerance, not bitwise equal (largest {worst:.1e})")


def refines(stock: dict[str, Any], ours: dict[str, Any]) -> bool:
    """Ours is an instance of stock's exception type and its message starts with stock's message."""
    is_instance = ours["type"] == stock["type"] or stock["type"] in ours.get("bases", [])
    return is_instance and ours["message"].startswith(stock["message"])


def _is_weights(value: dict) -> bool:
    return set(value) == {"sha256", "tensors"}


def _is_error(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"error"}


@dataclass
class Report:
    scenario: str
    unexpected: list[Difference]
    allowed: list[tuple[Difference, str]]
    notes: list[str]

    @property
    def ok(self) -> bool:
        return not self.unexpected

    def text(self) -> str:
        head = f"== {self.scenario}: " + (
            "same" if not (self.unexpected or self.allowed) else f"{len(self.unexpected)} difference(s)"
        )
        if self.allowed:
            head += f", {len(self.allowed)} allowed"
        lines = [head]
        lines += _grouped(self.unexpected, "  ")
        for difference, reason in self.allowed:
            lines.append(f"  allowed: {difference.describe()}  [{reason}]")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def _grouped(differences: list[Difference], indent: str) -> list[str]:
    """One line per difference; long runs at one path (per-step losses, say) are cut short."""
    lines, shown = [], {}
    for difference in differences:
        key = (re.sub(r"\[\d+\]", "[]", difference.path), difference.kind)
        shown[key] = shown.get(key, 0) + 1
        if shown[key] <= MAX_ITEMS_SHOWN:
            lines.append(indent + difference.describe())
        elif shown[key] == MAX_ITEMS_SHOWN + 1:
            total = sum(1 for d in differences if (re.sub(r"\[\d+\]", "[]", d.path), d.kind) == key)
            lines.append(f"{indent}… {total - MAX_ITEMS_SHOWN} more like {key[0]} ({key[1]})")
    return lines


def compare(stock: dict[str, Any], ours: dict[str, Any], scenario: str | None = None) -> Report:
    """The differences between two run_scenario results (their ``meta`` left out), sorted into allowed or not."""
    scenario = scenario or stock.get("meta", {}).get("scenario", "?")
    comparison = Comparison()
    stock_body = {k: v for k, v in stock.items() if k != "meta"}
    ours_body = {k: v for k, v in ours.items() if k != "meta"}
    broken = [
        f"{side}: {body['harness_error']}"
        for side, body in (("stock", stock), ("ours", ours))
        if "harness_error" in body
    ]
    if broken:  # no result to compare: never an allowed difference
        comparison.add(Difference("harness", "no result", item="; ".join(broken)))
        return Report(scenario, comparison.differences, [], [])
    if "error" in stock_body or "error" in ours_body:  # the scenario died outside its own stages
        comparison.errors("scenario", stock_body, ours_body)
    else:
        comparison.walk("", stock_body.get("result"), ours_body.get("result"))
    meta = ours.get("meta", {})
    for hidden in ("accelerate_imported", "peft_imported"):  # ``ours`` runs as where they are not installed
        if meta.get("impl") == "ours" and meta.get(hidden):
            comparison.add(Difference(f"meta.{hidden}", "value", None, True))
    unexpected, allowed = [], []
    for difference in comparison.differences:
        rule = next((a for a in ALLOWED if a.matches(scenario, difference)), None)
        if rule is None:
            unexpected.append(difference)
        else:
            allowed.append((difference, rule.reason))
    return Report(scenario, unexpected, allowed, comparison.notes)


def compare_files(stock_path: str | Path, ours_path: str | Path) -> Report:
    return compare(json.loads(Path(stock_path).read_text()), json.loads(Path(ours_path).read_text()))


def main(argv: list[str] | None = None) -> int:
    return compare_main(compare_files, argv, __doc__.split("\n\n")[0])


if __name__ == "__main__":
    sys.exit(main())
