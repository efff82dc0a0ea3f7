"""Through the real server on a tiny random Llama with `--n-seq-max 2`: twenty conversations,
then each continued once; every continuation's history comes from the cache (the prefix index
over held cells, scheduler/radix.py), and /metrics shows the index."""

from __future__ import annotations

import httpx
import pytest

from cli.main import build_settings, make_parser
from tests.live_server import start_server
from tests.server.test_prefix_sharing_server import scrape
from tests.tiny_models import write_tiny_gemma3, write_tiny_llama


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    folder = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    live = start_server(model=str(folder), n_cells=4096, n_seq_max=2, n_batch=128)
    yield live
    live.stop()


def cached_tokens(url: str, prompt: list[int]) -> int:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    out = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_twenty_conversations_on_two_seq_ids_all_continue_from_the_cache(server) -> None:  # noqa: ANN001
    url = server.url
    prompts = [[5 + (i * 13 + k * 7) % 200 for k in range(40)] for i in range(20)]
    for p in prompts:
        cached_tokens(url, p)
    for i, p in enumerate(prompts):  # without the index only the last 2 would be cached
        assert cached_tokens(url, p + [300 + i, 301, 302]) >= 40
    metrics = scrape(url)
    assert metrics["cellserve_prefix_index_nodes"] >= 20
    assert metrics["cellserve_prefix_index_cells"] >= 20 * 40


def test_slots_cached_lists_the_index_conversations_before_the_slots(server) -> None:  # noqa: ANN001
    prompts = [[7 + (i * 17 + k * 5) % 190 for k in range(50)] for i in range(6)]
    for p in prompts:
        cached_tokens(server.url, p)
    rows = httpx.get(f"{server.url}/slots/cached").json()
    indexed = [r for r in rows if r["source"] == "index"]
    slots = [r for r in rows if r["source"] == "slot"]
    assert rows == indexed + slots  # index rows first
    assert len(slots) <= 2 and all(r["id_slot"] >= 0 for r in slots)
    assert all(r["id_slot"] == -1 for r in indexed)
    assert len(indexed) >= 4  # six conversations on two seq ids: four or more left as leaves
    assert sum(r["n_tokens"] >= 50 for r in indexed) >= 4
    for part in (indexed, slots):
        assert [r["last_used"] for r in part] == sorted(r["last_used"] for r in part)


def test_no_prefix_index_keeps_only_the_holders(tmp_path) -> None:  # noqa: ANN001
    args = make_parser().parse_args(["serve", "--no-prefix-index", "--n-seq-max", "2"])
    settings = build_settings(args)
    assert settings.prefix_index is False
    folder = write_tiny_llama(tmp_path / "llama")
    live = start_server(
        model=str(folder), n_cells=4096, n_seq_max=2, n_batch=128, prefix_index=False
    )
    try:
        prompts = [[5 + (i * 13 + k * 7) % 200 for k in range(40)] for i in range(6)]
        for p in prompts:
            cached_tokens(live.url, p)
        # the first conversation's holder went when later ones needed its seq id
        assert cached_tokens(live.url, prompts[0] + [300, 301, 302]) == 0
        assert scrape(live.url)["cellserve_prefix_index_nodes"] == 0
    finally:
        live.stop()


def test_a_sliding_window_model_keeps_windows_past_the_holders(tmp_path) -> None:  # noqa: ANN001
    """A tiny Gemma 3 (window 8) with --n-seq-max 2: the index keeps each conversation's
    window within --swa-index-cells, and every continuation reuses its whole history."""
    args = make_parser().parse_args(["serve", "--swa-index-cells", "256"])
    assert build_settings(args).swa_index_cells == 256
    folder = write_tiny_gemma3(tmp_path / "gemma")
    prompts = [[5 + (i * 13 + k * 7) % 200 for k in range(40)] for i in range(8)]
    for index_cells in (256, 0):
        live = start_server(
            model=str(folder), n_cells=4096, n_seq_max=2, n_batch=128, swa_index_cells=index_cells
        )
        try:
            for p in prompts:
                # one token: what is computed ends with the prompt, so its window (positions
                # 32..39) serves the continuation below; a continuation must carry the answer
                # computed after the prompt, or the window of position 40 is not held
                body = {"prompt": p, "max_tokens": 1, "temperature": 0}
                httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).raise_for_status()
            hits = [cached_tokens(live.url, p + [300 + i, 301, 302]) for i, p in enumerate(prompts)]
            metrics = scrape(live.url)
        finally:
            live.stop()
        cells = metrics["cellserve_prefix_index_cells"]
        windows = metrics["cellserve_prefix_index_window_cells"]
        if index_cells:  # 8 windows of 8 cells fit in 256
            assert min(hits) >= 40 and cells >= 6 * 40 and 6 * 8 <= windows <= 256
        else:  # only the two holders: the first conversation's went long before
            assert hits[0] == 0 and cells == windows == 0
