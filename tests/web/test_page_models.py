"""The cell map of a server with several models (server/model_router.py): `?model=` picks the
loaded model whose cache `/v1/cache/cells` shows, and the page's map picker (filled from
/v1/models) chooses it. Fake engines, one per model; the browser tests need Chromium."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from server.backend import Backend
from tests.live_server import LiveServer, start_server
from tests.server.test_models_dir import write_gguf_header
from tests.web.fakes import FREE, FakeEngine, make_busy_engine
from tests.web.page import drawn_seqs, wait_for


def make_quiet_engine(seq_id: int = 3, n_cells: int = 64) -> FakeEngine:
    """Cells [0, 10) held by `seq_id`, no request running: the model is idle."""
    owner_map = np.full(n_cells, FREE, dtype=np.int32)
    owner_map[0:10] = seq_id
    return FakeEngine(n_cells, owner_map, [seq_id], head=10)


@pytest.fixture
def router_server(tmp_path: Path):
    """start(engines) -> a server with one model per engine (its name the key), none loaded."""
    started: list[LiveServer] = []

    def start(engines: dict[str, FakeEngine]) -> LiveServer:
        specs = []
        for name in engines:
            write_gguf_header(tmp_path / f"{name}.gguf")
            specs.append(f"{name}={tmp_path / f'{name}.gguf'}")

        def factory(settings, _on_step) -> Backend:
            engine = engines[settings.served_model_name]
            return Backend(engine, None, None, settings.served_model_name, 512, engine.n_cells, 0)

        started.append(start_server(factory, ready_timeout=20, models=specs, models_max=2))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def load(server: LiveServer, name: str) -> None:
    assert httpx.post(f"{server.url}/models/load", json={"model": name}).status_code == 200
    wait_for(
        lambda: any(
            m["id"] == name and m["status"]["value"] == "loaded"
            for m in httpx.get(f"{server.url}/models").json()["data"]
        ),
        what=f"{name} loaded",
    )


def cells(server: LiveServer, **params: str) -> httpx.Response:
    return httpx.get(f"{server.url}/v1/cache/cells", params=params, timeout=10)


def test_the_model_parameter_picks_the_cache(router_server) -> None:
    server = router_server({"busy": make_busy_engine(), "quiet": make_quiet_engine()})
    missing = cells(server)
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "model_required"
    unknown = cells(server, model="nope")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    not_loaded = cells(server, model="quiet")
    assert not_loaded.status_code == 400
    assert not_loaded.json()["error"]["code"] == "model_not_loaded"
    statuses = {
        m["id"]: m["status"]["value"] for m in httpx.get(f"{server.url}/models").json()["data"]
    }
    assert statuses == {"busy": "unloaded", "quiet": "unloaded"}  # watching loads nothing
    load(server, "busy")
    load(server, "quiet")
    assert cells(server, model="busy").json()["totals"]["used"] == 16
    quiet = cells(server, model="quiet").json()
    assert quiet["totals"]["used"] == 10 and quiet["head"] == 10


def test_the_stream_does_not_hold_its_model_and_ends_with_it(router_server) -> None:
    server = router_server({"busy": make_busy_engine(), "quiet": make_quiet_engine()})
    load(server, "quiet")
    url = f"{server.url}/v1/cache/cells/stream"
    with httpx.stream("GET", url, params={"model": "quiet", "interval_ms": 50}, timeout=10) as s:
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert json.loads(first.removeprefix("data:"))["totals"]["used"] == 10
        unload = httpx.post(f"{server.url}/models/unload", json={"model": "quiet"}, timeout=10)
        assert unload.status_code == 200, unload.text
        rest = list(lines)  # the stream ends once its model is gone
    assert not any(line.startswith("data:") for line in rest)


def test_the_page_chooses_the_map_model(router_server, browser) -> None:
    server = router_server({"busy": make_busy_engine(), "quiet": make_quiet_engine(seq_id=5)})
    load(server, "quiet")
    browser.get(server.url)
    picker = "return document.getElementById('map-model-picker').hidden"
    wait_for(lambda: browser.execute_script(picker) is False, what="the map's model picker")
    options = browser.execute_script(
        "return [...document.getElementById('map-model').options].map(o => o.value)"
    )
    assert options == ["busy", "quiet"]
    # the loaded model is shown first
    wait_for(lambda: drawn_seqs(browser) == {5}, what="quiet's cells")
    # choosing a model that is not loaded says so, then shows it once it is
    browser.execute_script(
        "const s = document.getElementById('map-model'); s.value = 'busy';"
        "s.dispatchEvent(new Event('change'));"
    )
    status = "return document.getElementById('conn-status').textContent"
    wait_for(lambda: "not loaded" in browser.execute_script(status), what="busy not loaded")
    load(server, "busy")
    wait_for(lambda: drawn_seqs(browser) == {-2, 0, 1, 7}, what="busy's cells")
    browser.get("about:blank")


def test_a_single_model_page_has_no_map_picker(open_page) -> None:
    browser = open_page(make_busy_engine())
    wait_for(lambda: drawn_seqs(browser), what="the first cell map")
    assert browser.execute_script("return document.getElementById('map-model-picker').hidden")
