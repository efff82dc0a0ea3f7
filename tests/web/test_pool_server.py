"""The whole server on a sliding-window model (a tiny random Gemma 3, window 8): the iSWA
memory is built from the model's spec, requests are served, /metrics and /v1/cache/cells
show both pools."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.live_server import start_server
from tests.tiny_models import write_tiny_gemma3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    folder = write_tiny_gemma3(Path(tmp_path_factory.mktemp("gemma")) / "tiny")
    live = start_server(
        model=str(folder), n_cells=512, n_seq_max=4, n_batch=32, ctx_per_seq=128, threads=1
    )
    yield live
    live.stop()


def test_a_sliding_window_model_is_served_on_two_pools(server) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for seed in range(3):
            body = {"prompt": f"hello {seed} " * 12, "max_tokens": 16, "temperature": 0}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 16
        cells = client.get("/v1/cache/cells").json()
        metrics = client.get("/metrics").text
    pools = {p["name"]: p for p in cells["pools"]}
    # the window pool: W x n_seq_max + n_batch, and n_cells / 4 for the prefix index's windows
    assert (pools["full"]["n_cells"], pools["swa"]["n_cells"]) == (512, 8 * 4 + 32 + 512 // 4)
    assert pools["swa"]["window"] == 8
    assert pools["full"]["used"] > pools["swa"]["used"] > 0  # the prefix cache's holders
    assert 'cellserve_kv_pool_cells_total{pool="swa"} 192.0' in metrics
    assert 'cellserve_kv_pool_cells_total{pool="full"} 512.0' in metrics
