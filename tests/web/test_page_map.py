"""The cell map as drawn in the browser, fed by a fake engine whose cells the test lays out."""

from __future__ import annotations

import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By

from tests.web.fakes import FREE, make_busy_engine
from tests.web.page import (
    cell_pixels,
    cell_rgb,
    close,
    counter,
    counter_int,
    drawn_seqs,
    holder_rgb,
    seq_rgb,
    table_rows,
    wait_for,
)

FREE_RGB = (0xEE, 0xF1, 0xF5)
HATCH_LIGHT = (0xFD, 0xE6, 0x8A)
HATCH_DARK = (0xB4, 0x53, 0x09)


@pytest.fixture
def busy_page(open_page):
    engine = make_busy_engine()
    browser = open_page(engine)
    wait_for(lambda: drawn_seqs(browser), what="the first cell map")
    return browser, engine


def test_cells_are_coloured_by_owner(busy_page):
    driver, _ = busy_page
    assert drawn_seqs(driver) == {-2, 0, 1, 7}
    for cell in range(0, 5):
        assert close(cell_rgb(driver, cell), seq_rgb(0)), cell
    for cell in range(8, 12):
        assert close(cell_rgb(driver, cell), seq_rgb(1)), cell
    for cell in range(20, 24):
        assert close(cell_rgb(driver, cell), holder_rgb(7)), cell
    for cell in (13, 30, 63):
        assert close(cell_rgb(driver, cell), FREE_RGB), cell


def test_shared_cells_are_hatched_and_the_head_is_outlined(busy_page):
    driver, _ = busy_page
    for cell in range(5, 8):
        pixels = cell_pixels(driver, cell)
        assert any(close(p, HATCH_LIGHT, 8) for p in pixels), cell
        assert any(close(p, HATCH_DARK, 8) for p in pixels), cell
    head_pixels = cell_pixels(driver, 12)
    assert any(close(p, (0xDC, 0x26, 0x26), 8) for p in head_pixels)
    assert not any(close(p, (0xDC, 0x26, 0x26), 8) for p in cell_pixels(driver, 13))


def test_rows_counters_and_legend(busy_page):
    driver, _ = busy_page
    rows = table_rows(driver)
    assert [(r["seq_id"], r["req_id"], r["cells"]) for r in rows] == [
        ("0", "chatcmpl-a", "8"),
        ("1", "chatcmpl-b", "7"),
    ]
    assert counter_int(driver, "total-used") == 16
    assert counter_int(driver, "total-shared") == 3
    assert counter_int(driver, "total-cached") == 4
    assert counter_int(driver, "total-free") == 48
    assert counter(driver, "prefix-hits") == "3 / 12 (25.0%)"
    legend = driver.execute_script("return document.getElementById('legend').textContent")
    assert "seq 0 · chatcmpl-a" in legend and "seq 1 · chatcmpl-b" in legend


def test_map_follows_the_engine_live(busy_page):
    driver, engine = busy_page
    engine.owner_map[engine.owner_map == 1] = FREE
    engine.live_slots = engine.live_slots[:1]
    wait_for(lambda: 1 not in drawn_seqs(driver), timeout=5, what="seq 1 to leave the map")
    assert close(cell_rgb(driver, 9), FREE_RGB)
    assert [r["seq_id"] for r in table_rows(driver)] == ["0"]
    assert counter_int(driver, "total-used") == 12


@pytest.mark.parametrize(
    ("cell", "text"),
    [
        (2, "cell 2: seq 0 (chatcmpl-a)"),
        (6, "cell 6: shared by 2+ sequences"),
        (21, "cell 21: prefix cache (seq 7)"),
        (40, "cell 40: free"),
    ],
)
def test_hovering_a_cell_names_its_owner(busy_page, cell, text):
    driver, _ = busy_page
    canvas = driver.find_element(By.ID, "cell-canvas")
    size, cols = (int(canvas.get_attribute(f"data-{k}")) for k in ("cell-size", "cols"))
    x = (cell % cols) * size + size // 2 - canvas.size["width"] // 2
    y = (cell // cols) * size + size // 2 - canvas.size["height"] // 2
    ActionChains(driver).move_to_element_with_offset(canvas, x, y).perform()
    tip = driver.find_element(By.ID, "cell-tip")
    wait_for(lambda: tip.is_displayed() and tip.text == text, 5, f"the tip {text!r}")
