"""Reading the page from Selenium: waits, cell pixels, the table and the counters."""

from __future__ import annotations

import colorsys
import time
from collections.abc import Callable
from typing import Any

CELL_PIXELS_JS = """
const [cell] = arguments;
const canvas = document.getElementById('cell-canvas');
const size = Number(canvas.dataset.cellSize), cols = Number(canvas.dataset.cols);
const dpr = canvas.width / (cols * size);
const x = Math.floor((cell % cols) * size * dpr);
const y = Math.floor(Math.floor(cell / cols) * size * dpr);
const w = Math.max(1, Math.floor((size - 1) * dpr));
const data = canvas.getContext('2d').getImageData(x, y, w, w).data;
const out = [];
for (let i = 0; i < data.length; i += 4) out.push([data[i], data[i + 1], data[i + 2]]);
return out;
"""


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def hsl_to_rgb(hue: float, sat: float, light: float) -> tuple[int, int, int]:
    r, g, b = colorsys.hls_to_rgb(hue / 360, light, sat)
    return round(r * 255), round(g * 255), round(b * 255)


def seq_rgb(seq_id: int) -> tuple[int, int, int]:
    """Mirrors seqColor() in cellmap.js."""
    return hsl_to_rgb((seq_id * 137.508 + 210) % 360, 0.70, 0.48)


def holder_rgb(seq_id: int) -> tuple[int, int, int]:
    return hsl_to_rgb((seq_id * 137.508 + 210) % 360, 0.30, 0.82)


def close(a, b, tol: int = 3) -> bool:
    return all(abs(int(x) - int(y)) <= tol for x, y in zip(a, b, strict=True))


def cell_pixels(driver, cell: int) -> list[list[int]]:
    """RGB of every device pixel inside a cell's square (the 1px grid gap excluded)."""
    return driver.execute_script(CELL_PIXELS_JS, cell)


def cell_rgb(driver, cell: int) -> list[int]:
    pixels = cell_pixels(driver, cell)
    return pixels[len(pixels) // 2 + 1]


def drawn_seqs(driver) -> set[int]:
    raw = driver.execute_script("return document.getElementById('cell-canvas').dataset.drawnSeqs")
    return {int(s) for s in raw.split(",")} if raw else set()


def table_rows(driver) -> list[dict[str, str]]:
    return driver.execute_script(
        """
        return [...document.querySelectorAll('#seq-table tbody tr[data-seq-id]')].map(tr => ({
            seq_id: tr.dataset.seqId, req_id: tr.dataset.reqId,
            cells: tr.children[6].textContent}));
        """
    )


def counter(driver, element_id: str) -> str:
    return driver.execute_script(f"return document.getElementById('{element_id}').textContent")


def counter_int(driver, element_id: str) -> int:
    text = counter(driver, element_id).split(" ")[0]
    return int(text.replace(",", ""))
