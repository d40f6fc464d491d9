"""Looking at what the report drew: PNG headers, pixels of a colour, a data point's pixels, Chromium screenshots."""

from __future__ import annotations

import functools
import os
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

BORDER = "#d0d7de"  # the page's table and figure border colour (trainer_ext/report/page.py)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's signature and IHDR chunk; fails on anything that is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def pixels(path: Path):
    import matplotlib.image

    return matplotlib.image.imread(str(path))[:, :, :3]


def colour_mask(image, hex_colour: str, tolerance: float = 0.06):
    import numpy as np

    rgb = np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return np.abs(image - rgb).max(axis=2) < tolerance


def count_colour(image, hex_colour: str, tolerance: float = 0.06) -> int:
    return int(colour_mask(image, hex_colour, tolerance).sum())


def colour_at(png: Path, ax: Any, x: float, y: float, hex_colour: str, radius: int = 5) -> int:
    """Pixels of ``hex_colour`` within ``radius`` of the data point (x, y) of ``ax`` in the saved ``png``."""
    image = pixels(png)
    px, py = ax.transData.transform((x, y))  # display pixels from the bottom left, as the PNG was saved
    row, col = int(round(image.shape[0] - py)), int(round(px))
    window = image[max(row - radius, 0) : row + radius + 1, max(col - radius, 0) : col + radius + 1]
    return count_colour(window, hex_colour)


def visible_ticks(ax: Any, which: str = "x") -> list[float]:
    """The tick positions inside the axis' view (matplotlib also places some just outside)."""
    lo, hi = sorted(ax.get_xlim() if which == "x" else ax.get_ylim())
    ticks = ax.get_xticks() if which == "x" else ax.get_yticks()
    return [float(t) for t in ticks if lo <= t <= hi]


def visible_tick_labels(ax: Any) -> list[str]:
    """The x tick labels drawn inside the axis' view."""
    lo, hi = sorted(ax.get_xlim())
    return [t.label1.get_text() for t in ax.xaxis.get_major_ticks() if lo <= t.get_loc() <= hi]


def chromium_or_skip() -> str:
    found = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if found is None:
        if os.environ.get("TRAINER_EXT_REQUIRE_CHROMIUM") == "1":
            pytest.fail("TRAINER_EXT_REQUIRE_CHROMIUM=1 but no chromium on PATH (apt-get install -y chromium)")
        pytest.skip("needs chromium (apt-get install -y chromium)")
    return found


def screenshot(page: Path, shot: Path, profile: Path, size: tuple[int, int]) -> None:
    """``page`` as headless Chromium draws it, in a window of ``size`` (width, height), into ``shot``."""
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        f"--screenshot={shot}",
        f"--window-size={size[0]},{size[1]}",
    ]
    proc = subprocess.run(
        [chromium_or_skip(), *flags, page.resolve().as_uri()], capture_output=True, text=True, timeout=120
    )
    assert shot.is_file(), proc.stderr[-2000:]
    assert png_size(shot) == size


def figure_boxes(image) -> list[tuple[int, int, int, int]]:
    """(top, bottom, left, right) inside each bordered box taller than 200 px on a screenshot of the page: the figures.

    Table rows share the border colour but are a few dozen pixels apart; a figure's top and bottom borders are
    hundreds apart with nothing of that colour across the width in between.
    """
    import numpy as np

    mask = colour_mask(image, BORDER, tolerance=0.03)
    rows = np.where(mask.sum(axis=1) >= 0.6 * image.shape[1])[0]
    boxes = []
    for top, bottom in zip(rows, rows[1:], strict=False):
        if bottom - top > 200:
            sides = np.where(mask[top + 5 : bottom - 5].mean(axis=0) > 0.95)[0]
            assert len(sides) >= 2, (top, bottom, sides)
            boxes.append((int(top) + 1, int(bottom), int(sides[0]) + 1, int(sides[-1])))
    return boxes


def _grid(picture):
    """Darkness averaged over a 15 × 30 grid of cells."""
    import numpy as np

    dark = 1 - picture.mean(axis=2)
    return np.array([[cell.mean() for cell in np.array_split(band, 30, axis=1)] for band in np.array_split(dark, 15)])


@functools.lru_cache(maxsize=32)
def _png_grid(path: Path):
    return _grid(pixels(path))


def shown_like(image, box: tuple[int, int, int, int], png: Path) -> float:
    """How well the screenshot's ``box`` matches ``png`` drawn at another scale: the correlation of their darkness
    over a coarse grid (the same picture: above 0.95; another figure of the report: below 0.85)."""
    import numpy as np

    top, bottom, left, right = box
    return float(np.corrcoef(_grid(image[top:bottom, left:right]).ravel(), _png_grid(png).ravel())[0, 1])
