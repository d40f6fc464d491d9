"""Chat data formats: detected from the columns, converted to canonical rows (one column layout per format).

Canonical rows:

- conversational SFT: ``{"messages": [{"role": ..., "content": str}, ...]}`` (roles system, user, assistant, tool)
- plain prompt/completion: ``{"prompt": str, "completion": str}``
- plain text: ``{"text": str}``
- preference: ``{"prompt", "chosen", "rejected"}``, all message lists (conversational) or all strings

Input formats: messages (OpenAI role/content or ShareGPT from/value, in a ``messages`` or ``conversations`` column),
prompt-completion (strings, or message lists: then conversational, messages = prompt + completion), alpaca
(instruction, optional input and system, output), text, preference (prompt/chosen/rejected, or chosen/rejected sharing
an implicit prompt, split as TRL's ``extract_prompt`` does). A malformed row is one ConfigError naming the source and
the row index (0-based, as ``dataset[i]``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from trainer_ext.chat.names import FORMATS
from trainer_ext.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    import datasets

TASK_FORMATS = {"sft": ("messages", "prompt-completion", "alpaca", "text"), "dpo": ("preference",)}
# canonical column names per format: required, then optional
REQUIRED = {
    "messages": ("messages",),
    "prompt-completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
    "preference": ("chosen", "rejected"),
}
OPTIONAL = {"alpaca": ("input", "system"), "preference": ("prompt",)}
CANONICAL_NAMES = (
    "messages",
    "prompt",
    "completion",
    "instruction",
    "input",
    "output",
    "system",
    "text",
    "chosen",
    "rejected",
)
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "tool": "tool", "function": "tool"}
SHAREGPT_ROLES.update({"user": "user", "assistant": "assistant"})
FORMATS_UNDERSTOOD = (
    "messages (messages or conversations), prompt-completion (prompt, completion), alpaca (instruction, input, "
    "output), text (text), preference (prompt, chosen, rejected)"
)
ROLES_UNDERSTOOD = "roles understood: system, user, assistant, tool (ShareGPT: human, gpt, system, tool, function)"
MAPPING_EXAMPLE = {
    "sft": "--column_mapping prompt=question,completion=answer",
    "dpo": "--column_mapping chosen=good,rejected=bad",
}


def parse_column_mapping(text: str | Mapping[str, str] | None) -> dict[str, str]:
    """``"canonical=file_column,..."`` (or a mapping) → {canonical name: file column}; {} for None or ''."""
    if text is None:
        return {}
    if isinstance(text, Mapping):
        pairs = [(str(k).strip(), v.strip() if isinstance(v, str) else v) for k, v in text.items()]
    else:
        pairs = []
        for entry in (e.strip() for e in str(text).split(",")):
            if not entry:
                continue
            name, sep, column = (part.strip() for part in entry.partition("="))
            if not sep or not name or not column:
                raise ConfigError(
                    f"--column_mapping entry {entry!r} is not name=column; "
                    "e.g. --column_mapping prompt=question,completion=answer"
                )
            pairs.append((name, column))
    mapping: dict[str, str] = {}
    for name, column in pairs:
        if name not in CANONICAL_NAMES:
            raise ConfigError(
                f"--column_mapping names {name!r}, which no format reads; names understood: "
                f"{', '.join(CANONICAL_NAMES)}.{did_you_mean(name, CANONICAL_NAMES)}"
            )
        if not isinstance(column, str) or not column:
            raise ConfigError(
                f"--column_mapping gives {name!r} no column name; e.g. --column_mapping {name}=my_column"
            )
        if name in mapping and mapping[name] != column:
            raise ConfigError(f"--column_mapping maps {name!r} twice ({mapping[name]!r} and {column!r}); keep one")
        mapping[name] = column
    return mapping


def _column(name: str, columns: Iterable[str], mapping: Mapping[str, str]) -> str | None:
    """The file column read as canonical ``name``, or None when the data has none."""
    columns = list(columns)
    if name in mapping:
        return mapping[name]
    if name in columns:
        return name
    if name == "messages" and "conversations" in columns:
        return "conversations"
    return None


def _has(fmt: str, columns: list[str], mapping: Mapping[str, str]) -> bool:
    return all(_column(name, columns, mapping) in columns for name in REQUIRED[fmt])


def detect_format(columns: Iterable[str], task: str, data_format: str, mapping: Mapping[str, str]) -> str:
    """The format of data with these columns: ``data_format`` checked, or told by the columns when it is auto."""
    columns = list(columns)
    if task not in TASK_FORMATS:
        raise ConfigError(f"chat data is read for --task sft or dpo, not {task!r}")
    allowed = TASK_FORMATS[task]
    present = ", ".join(columns) or "none"
    for name, column in mapping.items():
        if column not in columns:
            raise ConfigError(
                f"--column_mapping reads {name!r} from column {column!r}, but the data has no such column "
                f"(columns: {present}).{did_you_mean(column, columns)}"
            )
    fix = f"pass --data_format and --column_mapping, e.g. {MAPPING_EXAMPLE[task]}"
    if data_format != "auto":
        if data_format not in FORMATS:
            raise ConfigError(
                f"--data_format {data_format!r} is not a format; formats: auto, {', '.join(FORMATS)}."
                f"{did_you_mean(data_format, FORMATS)}"
            )
        if data_format not in allowed:
            raise ConfigError(
                f"--data_format {data_format} is not read by --task {task}; --task {task} reads "
                f"{', '.join(allowed)} data"
            )
        missing = [n for n in REQUIRED[data_format] if _column(n, columns, mapping) not in columns]
        if missing:
            wanted = " and ".join(repr(n) for n in missing)
            raise ConfigError(
                f"--data_format {data_format} needs the column{'s' * (len(missing) > 1)} {wanted}, which the data "
                f"lacks (columns: {present}); formats understood: {FORMATS_UNDERSTOOD}; {fix}"
            )
        return data_format
    for fmt in allowed:
        if _has(fmt, columns, mapping):
            return fmt
    if task == "dpo":
        missing = [n for n in ("chosen", "rejected") if _column(n, columns, mapping) not in columns]
        wanted = " and ".join(repr(n) for n in missing)
        raise ConfigError(
            f"the data has no {wanted} column{'s' * (len(missing) > 1)} (columns: {present}); --task dpo reads "
            f"preference data (prompt, chosen, rejected; prompt optional when chosen and rejected are whole "
            f"conversations sharing it); formats understood: {FORMATS_UNDERSTOOD}; {fix}"
        )
    raise ConfigError(
        f"the data has no 'messages' column (nor prompt/completion, instruction/output or text; columns: {present}); "
        f"formats understood: {FORMATS_UNDERSTOOD}; {fix}"
    )


def _message_features() -> list:
    from datasets import Value

    return [{"role": Value("string"), "content": Value("string")}]


class _Rows:
    """Row checks that name the source and the row."""

    def __init__(self, source: str, task: str) -> None:
        self.source, self.task = source, task

    def fail(self, index: int, what: str) -> NoReturn:
        raise ConfigError(f"{self.source!r} row {index}: {what}")

    def text(self, value: Any, index: int, name: str, optional: bool = False) -> str:
        if value is None:
            if optional:
                return ""
            self.fail(index, f"{name!r} is empty (null); give it text")
        if not isinstance(value, str):
            self.fail(index, f"{name!r} is a {type(value).__name__}, not text")
        return value

    def messages(self, value: Any, index: int, name: str, need_assistant: bool) -> list[dict[str, str]]:
        if value is None or (isinstance(value, list) and not value):
            self.fail(index, f"{name!r} is an empty conversation; give it at least one message")
        if not isinstance(value, list):
            self.fail(index, f"{name!r} is a {type(value).__name__}, not a list of messages")
        out = []
        for number, message in enumerate(value):
            if not isinstance(message, Mapping):
                self.fail(index, f"message {number} of {name!r} is a {type(message).__name__}, not a message")
            if message.get("role") is not None or message.get("from") is None:
                role, content, roles = message.get("role"), message.get("content"), {r: r for r in ROLES}
            else:
                role, content, roles = message.get("from"), message.get("value"), SHAREGPT_ROLES
            if role not in roles:
                role_text = "no role" if role is None else f"role {role!r}"
                self.fail(index, f"message {number} has {role_text}; {ROLES_UNDERSTOOD}")
            if not isinstance(content, str):
                what = "no content (null)" if content is None else f"{type(content).__name__} content, not text"
                self.fail(index, f"message {number} ({roles[role]}) has {what}")
            out.append({"role": roles[role], "content": content})
        if need_assistant and not any(m["role"] == "assistant" for m in out):
            self.fail(index, f"{name!r} has no assistant message; sft learns from the assistant's messages")
        return out


def extract_prompt(chosen: list | str, rejected: list | str) -> tuple[list | str, list | str, list | str]:
    """(prompt, chosen, rejected): the longest shared prefix split off, exactly as TRL's ``extract_prompt``."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # remove space before the prompt
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _cast_scalars(dataset: datasets.Dataset, columns: Iterable[str]) -> datasets.Dataset:
    """Numeric scalar columns (a CSV of numbers) read as text."""
    from datasets import Value

    for column in columns:
        feature = dataset.features.get(column)
        if isinstance(feature, Value) and feature.dtype != "string" and feature.dtype != "large_string":
            if feature.dtype.startswith(("int", "uint", "float")):
                dataset = dataset.cast_column(column, Value("string"))
    return dataset


def _is_list_feature(feature: Any) -> bool:
    from datasets import LargeList, List

    return isinstance(feature, (list, List, LargeList))


def to_canonical(dataset: datasets.Dataset, fmt: str, mapping: Mapping[str, str], source: str) -> datasets.Dataset:
    """The canonical rows of ``dataset`` read as ``fmt`` (columns renamed by ``mapping``); every row checked."""
    from datasets import Features, Value

    if fmt not in FORMATS:
        raise ConfigError(f"unknown chat data format {fmt!r}; formats: {', '.join(FORMATS)}")
    columns = list(dataset.column_names)
    names = {n: _column(n, columns, mapping) for n in REQUIRED[fmt] + OPTIONAL.get(fmt, ())}
    names = {n: c for n, c in names.items() if c in columns}
    missing = [n for n in REQUIRED[fmt] if n not in names]
    if missing:
        raise ConfigError(
            f"{source!r} has no {' or '.join(repr(n) for n in missing)} column for --data_format {fmt} "
            f"(columns: {', '.join(columns) or 'none'})"
        )
    rows = _Rows(source, "dpo" if fmt == "preference" else "sft")
    messages, text = _message_features(), Value("string")
    conversational = False
    if fmt == "messages":
        features = Features({"messages": messages})

        def convert(row: dict, index: int) -> dict:
            return {"messages": rows.messages(row[names["messages"]], index, names["messages"], True)}

    elif fmt == "text":
        dataset = _cast_scalars(dataset, [names["text"]])
        features = Features({"text": text})

        def convert(row: dict, index: int) -> dict:
            return {"text": rows.text(row[names["text"]], index, names["text"])}

    elif fmt == "alpaca":
        dataset = _cast_scalars(dataset, names.values())
        features = Features({"messages": messages})

        def convert(row: dict, index: int) -> dict:
            get = {n: rows.text(row[c], index, c, optional=n in OPTIONAL["alpaca"]) for n, c in names.items()}
            user = get["instruction"] + ("\n\n" + get["input"] if get.get("input") else "")
            out = [{"role": "system", "content": get["system"]}] if get.get("system") else []
            out += [{"role": "user", "content": user}, {"role": "assistant", "content": get["output"]}]
            return {"messages": out}

    elif fmt == "prompt-completion":
        prompt_list = _is_list_feature(dataset.features[names["prompt"]])
        completion_list = _is_list_feature(dataset.features[names["completion"]])
        if prompt_list != completion_list:
            kinds = {True: "a list of messages", False: "text"}
            raise ConfigError(
                f"{source!r}: {names['prompt']!r} is {kinds[prompt_list]} but {names['completion']!r} is "
                f"{kinds[completion_list]}; give both as text or both as message lists"
            )
        conversational = prompt_list
        if conversational:
            features = Features({"messages": messages})

            def convert(row: dict, index: int) -> dict:
                prompt = rows.messages(row[names["prompt"]], index, names["prompt"], False)
                completion = rows.messages(row[names["completion"]], index, names["completion"], False)
                if not any(m["role"] == "assistant" for m in completion):
                    rows.fail(index, f"{names['completion']!r} has no assistant message")
                return {"messages": prompt + completion}

        else:
            dataset = _cast_scalars(dataset, names.values())
            features = Features({"prompt": text, "completion": text})

            def convert(row: dict, index: int) -> dict:
                return {n: rows.text(row[c], index, c) for n, c in names.items()}

    else:  # preference
        kinds = {n: _is_list_feature(dataset.features[c]) for n, c in names.items()}
        conversational = kinds["chosen"]
        if len(set(kinds.values())) > 1:
            described = ", ".join(f"{names[n]!r} is {'messages' if k else 'text'}" for n, k in kinds.items())
            raise ConfigError(
                f"{source!r}: {described}; give prompt, chosen and rejected all as text or all as message lists"
            )
        if not conversational:
            dataset = _cast_scalars(dataset, names.values())
        kind = messages if conversational else text
        features = Features({"prompt": kind, "chosen": kind, "rejected": kind})

        def read(row: dict, index: int, name: str) -> list | str:
            if conversational:
                return rows.messages(row[names[name]], index, names[name], False)
            return rows.text(row[names[name]], index, names[name])

        def convert(row: dict, index: int) -> dict:
            chosen, rejected = read(row, index, "chosen"), read(row, index, "rejected")
            if "prompt" in names:
                prompt = read(row, index, "prompt")
            else:
                prompt, chosen, rejected = extract_prompt(chosen, rejected)
                if not prompt:
                    rows.fail(
                        index,
                        "chosen and rejected share no prompt (they differ from the first "
                        f"{'message' if conversational else 'character'}); give the prompt in a 'prompt' column",
                    )
            if conversational:
                for name, value in (("chosen", chosen), ("rejected", rejected)):
                    if not any(m["role"] == "assistant" for m in value):
                        rows.fail(index, f"{name!r} has no assistant message after the prompt")
            return {"prompt": prompt, "chosen": chosen, "rejected": rejected}

    return dataset.map(
        convert,
        with_indices=True,
        remove_columns=dataset.column_names,
        features=features,
        desc=f"Reading {fmt} rows",
    )
