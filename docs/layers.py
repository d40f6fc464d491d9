"""Draw docs/layers.svg, the picture of trainer_ext's layers in docs/design.md, from the description below.

Run ``python docs/layers.py`` after changing LAYERS or BESIDE; ``tests/test_docs.py`` checks the SVG is current.
Standard library only: the picture is plain SVG text, the same bytes on every machine.
"""

from __future__ import annotations

import sys
from html import escape
from pathlib import Path

# top to bottom: (layer, packages, what it holds); each imports only from the layers below it
LAYERS: list[tuple[str, str, str]] = [
    ("CLI", "cli/ · cli/launch/", "trainer-ext train / launch / config / env / estimate / plan / report / checkpoint / test"),
    (
        "job",
        "job/ · job/builtin_data/",
        "train(args): flags and config files, TrainJobArguments, data, model, LoRA, sft/dpo, output folder",
    ),
    (
        "Trainer / Accelerator",
        "trainer/ · accelerator/",
        "drop-in Trainer and TrainingArguments; Accelerator for loops",
    ),
    (
        "engine",
        "distributed/ · distributed/data/",
        "Engine: prepare, backward, accumulate, gather; state, precision, data",
    ),
    (
        "strategies",
        "distributed/strategies/ · …/fsdp/ · …/deepspeed/",
        "single, ddp, fsdp, deepspeed behind one registry",
    ),
    (
        "checkpoint I/O",
        "checkpointing/",
        "commit, marker, verification, selection, rotation, sharded files, loop state",
    ),
    (
        "leaves",
        "errors · values · config_files · env_vars · field_types",
        "imported by anyone; they import only errors",
    ),
]
# packages beside the stack: (package, what it holds, the highest layer of the stack it imports)
BESIDE: list[tuple[str, str, str]] = [
    ("callbacks/", "logging, barriers, NaN guard, throughput", "engine"),
    ("chat/", "chat formats, templates, packing, DPO", "Trainer / Accelerator"),
    ("report/", "trainer-ext report: figures, page", "checkpoint I/O"),
    ("estimate/", "memory per rank before a job runs", "job"),
    ("plan/", "ranked layouts, verified by real steps", "job"),
    ("inference/", "device maps, offload, dispatch", "engine"),
    ("metrics/ · trackers/", "offline metrics; loop trackers", "leaves"),
]

WIDTH, BOX_W, BOX_H, GAP, LEFT, TOP = 1060, 600, 58, 22, 20, 50
SIDE_X, SIDE_W, SIDE_H = LEFT + BOX_W + 50, 370, 52
FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"


def _text(x: float, y: float, words: str, size: int, weight: str = "normal", fill: str = "#222") -> str:
    return f"<text x='{x:.0f}' y='{y:.0f}' font-size='{size}' font-weight='{weight}' fill='{fill}' {FONT}>{escape(words)}</text>"


def _box(x: float, y: float, w: float, h: float, fill: str) -> str:
    return f"<rect x='{x:.0f}' y='{y:.0f}' width='{w:.0f}' height='{h:.0f}' rx='6' fill='{fill}' stroke='#556' stroke-width='1.2'/>"


def _arrow(x: float, y1: float, y2: float) -> str:
    return f"<line x1='{x:.0f}' y1='{y1:.0f}' x2='{x:.0f}' y2='{y2:.0f}' stroke='#556' stroke-width='1.6' marker-end='url(#arrow)'/>"


def render() -> str:
    """The SVG document for LAYERS and BESIDE."""
    height = TOP + len(LAYERS) * (BOX_H + GAP)
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height}' viewBox='0 0 {WIDTH} {height}'>",
        "<defs><marker id='arrow' viewBox='0 0 10 10' refX='9' refY='5' markerWidth='7' markerHeight='7' "
        "orient='auto-start-reverse'><path d='M0,0 L10,5 L0,10 z' fill='#556'/></marker></defs>",
        "<rect width='100%' height='100%' fill='white'/>",
        _text(LEFT, 28, "trainer_ext: each layer imports only from the layers below it (arrows: imports)", 16, "bold"),
        _text(SIDE_X, 44, "beside the stack (→ the highest layer each imports)", 12, "normal", "#555"),
    ]
    tops = {}
    for i, (name, packages, holds) in enumerate(LAYERS):
        y = TOP + i * (BOX_H + GAP)
        tops[name] = y
        fill = "#eef3fb" if name != "leaves" else "#f4f4f4"
        out.append(_box(LEFT, y, BOX_W, BOX_H, fill))
        out.append(_text(LEFT + 12, y + 22, name, 15, "bold"))
        out.append(_text(LEFT + 230, y + 22, packages, 13, "normal", "#1a4d8f"))
        out.append(_text(LEFT + 12, y + 44, holds, 12, "normal", "#333"))
        if i:
            out.append(_arrow(LEFT + BOX_W / 2, y - GAP, y - 2))
    for i, (package, holds, lowest) in enumerate(BESIDE):
        y = TOP + 4 + i * (SIDE_H + 14)
        out.append(_box(SIDE_X, y, SIDE_W, SIDE_H, "#fbf6e9"))
        out.append(_text(SIDE_X + 10, y + 20, package, 13, "bold", "#1a4d8f"))
        out.append(_text(SIDE_X + 10, y + 40, f"{holds} (→ {lowest})", 11, "normal", "#333"))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    """Write docs/layers.svg (or the path given)."""
    target = Path(argv[0]) if argv else Path(__file__).with_name("layers.svg")
    target.write_text(render(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
