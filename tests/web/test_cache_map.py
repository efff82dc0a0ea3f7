"""The cell-map endpoints against a fake engine: encoding, totals, auth, the SSE stream."""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.cache_map import decode_runs, encode_runs
from tests.web.fakes import FakeEngine, make_busy_engine


@given(st.lists(st.integers(min_value=-2, max_value=5), max_size=200))
def test_runs_round_trip(values):
    owner_map = np.array(values, dtype=np.int32)
    runs = encode_runs(owner_map)
    assert np.array_equal(decode_runs(runs), owner_map)
    assert all(a != b for a, b in zip(runs[0:-2:2], runs[2::2], strict=False))  # maximal runs


def test_runs_stay_compact_for_a_large_cache():
    owner_map = np.full(65_536, -1, dtype=np.int32)
    owner_map[1000:1500] = 3
    owner_map[30_000:30_010] = -2
    assert encode_runs(owner_map) == [-1, 1000, 3, 500, -1, 28_500, -2, 10, -1, 35_526]


def test_snapshot_reports_owners_rows_and_totals(fake_server):
    server = fake_server(make_busy_engine())
    body = httpx.get(f"{server.url}/v1/cache/cells").json()
    owners = decode_runs(body["owner_runs"])
    assert body["n_cells"] == 64 and owners.size == 64 and body["head"] == 12
    assert list(owners[:12]) == [0] * 5 + [-2] * 3 + [1] * 4
    assert [row["seq_id"] for row in body["slots"]] == [0, 1]
    assert body["slots"][0]["req_id"] == "chatcmpl-a" and body["slots"][0]["cells_shared"] == 3
    assert body["holder_seq_ids"] == [7]
    assert body["totals"] == {"used": 16, "shared": 3, "cached": 4, "free": 48}
    assert body["prefix_cache"] == {"hit_tokens": 3, "queried_tokens": 12}
    assert body["num_context_shifts"] == 0 and body["num_preemptions"] == 0


def test_large_cache_snapshot_is_small(fake_server):
    engine = FakeEngine(n_cells=65_536, owner_map=np.full(65_536, -1, dtype=np.int32))
    engine.owner_map[:4096] = 0
    response = httpx.get(f"{fake_server(engine).url}/v1/cache/cells")
    assert response.json()["totals"]["free"] == 65_536 - 4096
    assert len(response.content) < 1000


def test_api_key_is_required_when_configured(fake_server):
    client = httpx.Client(base_url=fake_server(make_busy_engine(), api_key="sekret").url)
    assert client.get("/v1/cache/cells").status_code == 401
    bad = client.get("/v1/cache/cells", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    ok = client.get("/v1/cache/cells", headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200 and ok.json()["totals"]["used"] == 16
    stream = client.get("/v1/cache/cells/stream")
    assert stream.status_code == 401


def test_stream_sends_changes_and_stops_when_the_client_leaves(fake_server):
    engine = make_busy_engine()
    with httpx.Client(base_url=fake_server(engine).url) as client:
        with client.stream("GET", "/v1/cache/cells/stream?interval_ms=50") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = response.iter_lines()
            first = next(json.loads(line[5:]) for line in lines if line.startswith("data:"))
            assert first["totals"]["used"] == 16
            engine.owner_map[30:40] = 2
            second = next(json.loads(line[5:]) for line in lines if line.startswith("data:"))
            assert second["totals"]["used"] == 26
        calls_after_close = engine.num_calls
        time.sleep(0.5)
        assert engine.num_calls - calls_after_close <= 2


@pytest.mark.parametrize("interval_ms", [10, 10_000])
def test_stream_interval_is_bounded(fake_server, interval_ms):
    url = fake_server(make_busy_engine()).url
    response = httpx.get(f"{url}/v1/cache/cells/stream?interval_ms={interval_ms}")
    assert response.status_code == 400
