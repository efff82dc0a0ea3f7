"""The prefix cache's second tier through the real server on a tiny random Llama: a prompt
seen before a restart is a prefix hit after it (`--cache-dir`), one evicted from a small live
cache comes back from host RAM (`--cache-ram`), with the same greedy text, and /metrics counts
the tier's entries and hits."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.live_server import start_server
from tests.tiny_models import write_tiny_llama


def prompt(i: int, n_items: int = 40) -> str:
    return " ".join(f"topic{i} item{j} and" for j in range(n_items))


def complete(url: str, text: str) -> dict:
    body = {"prompt": text, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def tier_metrics(url: str) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name.startswith("cellserve_cache_tier_"):
                out[(s.name, s.labels["tier"])] = s.value
    return out


def serve(folder: Path, **kw: object):  # noqa: ANN201
    kw = {"n_seq_max": 4, **kw}
    return start_server(
        model=str(folder), dtype="float32", batch_invariant=True, cache_tier_min_tokens=16, **kw
    )


def test_a_prompt_seen_before_a_restart_is_a_prefix_hit(tmp_path: Path) -> None:
    folder = write_tiny_llama(tmp_path / "llama")
    cache = tmp_path / "cache"
    first = serve(folder, n_cells=2048, cache_dir=str(cache))
    try:
        cold = complete(first.url, prompt(0))
    finally:
        first.stop()
    assert len(list(cache.glob("*.cells"))) == 1
    second = serve(folder, n_cells=2048, cache_dir=str(cache))
    try:
        assert tier_metrics(second.url)[("cellserve_cache_tier_entries", "disk")] == 1
        warm = complete(second.url, prompt(0))
        n = warm["usage"]["prompt_tokens"]
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * n
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        m = tier_metrics(second.url)
        assert m[("cellserve_cache_tier_hits_total", "disk")] == 1
        assert m[("cellserve_cache_tier_hit_tokens_total", "disk")] >= 0.9 * n
    finally:
        second.stop()


def test_an_evicted_prompt_comes_back_from_ram(tmp_path: Path) -> None:
    folder = write_tiny_llama(tmp_path / "llama")
    # two seq ids: one holder at a time, so the live cache forgets each prompt at the next one
    server = serve(folder, n_cells=512, ctx_per_seq=256, n_seq_max=2, cache_ram=64)
    try:
        cold = complete(server.url, prompt(0, 10))
        for i in range(1, 6):
            complete(server.url, prompt(i, 10))
        # 512 cells keep three of the six 145-token conversations (two slots, one in the index)
        assert len(httpx.get(f"{server.url}/slots/cached").json()) <= 3
        warm = complete(server.url, prompt(0, 10))
        n = warm["usage"]["prompt_tokens"]
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * n
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        m = tier_metrics(server.url)
        assert m[("cellserve_cache_tier_hits_total", "ram")] >= 1
        assert m[("cellserve_cache_tier_entries", "ram")] >= 6
        assert m[("cellserve_cache_tier_bytes", "ram")] > 0
    finally:
        server.stop()
