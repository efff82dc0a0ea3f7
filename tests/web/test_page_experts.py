"""A mixture-of-experts model's expert load beside the cell map: in /v1/cache/cells (the same
counts /metrics exports) and on the page, one bar per expert and the most uneven layer."""

from __future__ import annotations

import httpx

from tests.web.fakes import make_busy_engine
from tests.web.page import wait_for

# 2 MoE layers x 4 experts; layer 1 sends 6 of its 8 rows to expert 2 (3.00x an even share),
# expert 3 is never chosen
ROWS = [[3, 3, 2, 0], [1, 1, 6, 0]]

EXPERTS_JS = """
const box = document.getElementById('expert-box');
if (getComputedStyle(box).display === 'none') return null;
const bars = [...document.querySelectorAll('#expert-bars > span')];
return {text: document.getElementById('expert-load').textContent,
        heights: bars.map((b) => b.style.height), titles: bars.map((b) => b.title)};
"""


def test_the_cell_map_carries_the_expert_load(fake_server):
    counts = [list(r) for r in ROWS]
    server = fake_server(make_busy_engine(), expert_load=lambda: counts)
    assert httpx.get(f"{server.url}/v1/cache/cells").json()["experts"] == {"rows": ROWS}
    counts[0][0] += 5  # read at every snapshot, not once
    assert httpx.get(f"{server.url}/v1/cache/cells").json()["experts"]["rows"][0][0] == 8
    dense = fake_server(make_busy_engine())
    assert httpx.get(f"{dense.url}/v1/cache/cells").json()["experts"] is None


def test_the_page_shows_the_expert_load(open_page):  # type: ignore[no-untyped-def]
    driver = open_page(make_busy_engine(), expert_load=lambda: ROWS)
    view = wait_for(lambda: driver.execute_script(EXPERTS_JS), what="the expert load box")
    assert view["text"] == (
        "4 experts × 2 layers · 16 rows routed · busiest: expert 2 of layer 1 at 3.00x an even "
        "share · 1 never chosen"
    )
    # per expert over both layers: 4, 4, 8, 0 rows; bars relative to the busiest (an idle
    # expert keeps a 2% sliver)
    assert view["heights"] == ["50%", "50%", "100%", "2%"]
    assert view["titles"][2] == "expert 2: 8 rows (50.0%)"


def test_a_dense_model_without_speculation_shows_neither_box(open_page):  # type: ignore[no-untyped-def]
    driver = open_page(make_busy_engine())
    wait_for(
        lambda: driver.find_element("id", "total-used").text not in ("", "–"), what="the counters"
    )
    assert driver.execute_script(EXPERTS_JS) is None
    # nor the speculative box of a server without speculation (the counters' `display: flex`
    # once showed a hidden box)
    shown = "return getComputedStyle(document.getElementById('spec-box')).display"
    assert driver.execute_script(shown) == "none"
