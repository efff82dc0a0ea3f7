"""A sliding-window model's second pool on the cell map: its own labelled canvas."""

from __future__ import annotations

import numpy as np

from scheduler.stats import CellMapSnapshot, PoolMap
from tests.web.fakes import FREE, FakeEngine, make_busy_engine
from tests.web.page import wait_for

SWA_CELLS = 24


class TwoPoolEngine(FakeEngine):
    """The busy engine's map as the full pool, and a window pool with seq 0 at [0, 4) and
    seq 1 at [10, 13)."""

    def cell_map(self) -> CellMapSnapshot:
        snap = super().cell_map()
        swa = np.full(SWA_CELLS, FREE, dtype=np.int32)
        swa[0:4] = 0
        swa[10:13] = 1
        snap.pools = [
            PoolMap("full", 0, snap.n_cells, snap.head, snap.owner_map),
            PoolMap("swa", 4, SWA_CELLS, 13, swa),
        ]
        return snap


POOL_JS = """
const wrap = document.querySelector('.pool-wrap[data-pool="swa"]');
if (!wrap) return null;
const canvas = wrap.querySelector('canvas');
return {label: wrap.querySelector('.pool-label').textContent,
        drawn: canvas.dataset.drawnSeqs, width: canvas.width};
"""


def test_the_window_pool_gets_a_labelled_canvas(open_page):
    busy = make_busy_engine()
    engine = TwoPoolEngine(
        busy.n_cells, busy.owner_map, busy.holders, busy.live_slots, busy.head, busy.counters
    )
    driver = open_page(engine)
    view = wait_for(lambda: driver.execute_script(POOL_JS), what="the swa pool's canvas")
    assert view["label"] == f"swa pool · window 4 · 7 / {SWA_CELLS} cells used"
    assert view["drawn"] == "0,1" and view["width"] > 0
    main = driver.execute_script("return document.getElementById('cell-canvas').dataset.drawnSeqs")
    assert main == "-2,0,1,7"  # the full pool stays on the main canvas
    labels = driver.execute_script(
        "return [...document.querySelectorAll('.pool-label')].map(e => e.textContent)"
    )
    assert labels[0].startswith("full pool · ")
