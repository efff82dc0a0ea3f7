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


FETCH_SPY_JS = """
window.__chatBodies = [];
const realFetch = window.fetch;
window.fetch = (url, options) => {
  if (String(url).includes('/v1/chat/completions')) {
    window.__chatBodies.push(JSON.parse(options.body));
  }
  return realFetch(url, options);
};
"""


def spy_on_chat_requests(driver) -> None:
    driver.execute_script(FETCH_SPY_JS)


def chat_bodies(driver) -> list[dict]:
    return driver.execute_script("return window.__chatBodies")


def set_generation(driver, max_tokens: int, ignore_eos: bool, temperature: float = 0.0) -> None:
    """Fills the Settings panel the way a user does."""
    from selenium.webdriver.common.by import By

    if not driver.execute_script("return document.querySelector('details.settings').open"):
        driver.find_element(By.CSS_SELECTOR, "details.settings summary").click()
    for element_id, value in (("max-tokens", max_tokens), ("temperature", temperature)):
        field = driver.find_element(By.ID, element_id)
        field.clear()
        field.send_keys(str(value))
    box = driver.find_element(By.ID, "ignore-eos")
    if box.is_selected() != ignore_eos:
        box.click()


def ask(driver, text: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    wait_for(lambda: driver.find_element(By.ID, "send").is_enabled(), what="the Send button")
    driver.find_element(By.ID, "prompt").send_keys(text, Keys.ENTER)


def last_reply(driver) -> dict[str, str]:
    return driver.execute_script(
        """
        const all = document.querySelectorAll('.msg.assistant');
        const last = all[all.length - 1];
        if (!last) return null;
        return {text: last.dataset.raw ?? '', shown: last.querySelector('.msg-body').textContent,
                classes: last.className,
                meta: last.querySelector('.msg-meta').textContent, count: all.length};
        """
    )
