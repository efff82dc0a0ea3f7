"""The page against the real server on SmolLM2: streamed chat, the live map, stop, the API key."""

from __future__ import annotations

import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from selenium.webdriver.common.by import By

from kvcache.cells import FREE, HELD, SHARED
from server.cache_map import decode_runs
from tests.web.page import (
    ask,
    chat_bodies,
    counter_int,
    drawn_seqs,
    last_reply,
    set_generation,
    spy_on_chat_requests,
    table_rows,
    wait_for,
)

pytestmark = pytest.mark.model

KEY = "sk-live-page-test"


@pytest.fixture
def page(browser, live_server):
    wait_idle(live_server.url)
    browser.get(live_server.url + "/")
    wait_for(lambda: browser.find_element(By.ID, "model").get_attribute("value"), what="models")
    wait_for(lambda: counter(browser, "total-free") != "–", what="the first cell map")
    spy_on_chat_requests(browser)
    return browser


def counter(driver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def get_json(url: str, path: str, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(url + path, headers=headers, timeout=10)
    response.raise_for_status()
    return response.json()


def wait_idle(url: str, timeout: float = 60) -> dict:
    def idle():
        cells = get_json(url, "/v1/cache/cells")
        return cells if cells["num_running"] == 0 and cells["num_waiting"] == 0 else None

    return wait_for(idle, timeout, "an idle engine")


def wait_reply_done(driver, timeout: float = 60) -> dict[str, str]:
    return wait_for(
        lambda: (r := last_reply(driver)) and "done" in r["classes"] and r, timeout, "the reply"
    )


def stream_in_background(url: str, max_tokens: int) -> threading.Thread:
    body = {
        "messages": [{"role": "user", "content": "Count from one to fifty in words."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }

    def run():
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_question_gets_a_streamed_answer_and_history_is_kept(page, artifacts_dir):
    set_generation(page, max_tokens=24, ignore_eos=True)
    ask(page, "Name three colours.")
    lengths = set()

    def growing():
        reply = last_reply(page)
        lengths.add(len(reply["text"]) if "streaming" in reply["classes"] else -1)
        return len(lengths - {0, -1}) >= 2

    wait_for(growing, 60, "the answer to grow while streaming")
    page.save_screenshot(str(artifacts_dir / "web_chat_midstream.png"))
    first = wait_reply_done(page)
    assert first["text"].strip() and "failed" not in first["classes"]
    assert "24 tokens" in first["meta"]

    set_generation(page, max_tokens=4, ignore_eos=True)
    ask(page, "And three more?")
    wait_reply_done(page)
    bodies = chat_bodies(page)
    assert [m["role"] for m in bodies[1]["messages"]] == ["system", "user", "assistant", "user"]
    assert bodies[1]["messages"][2]["content"] == first["text"]
    assert bodies[1]["stream"] is True and bodies[1]["max_tokens"] == 4


def test_map_shows_two_streams_then_frees_their_cells(page, live_server, artifacts_dir):
    set_generation(page, max_tokens=20, ignore_eos=True)
    background = stream_in_background(live_server.url, max_tokens=40)
    ask(page, "Write a short poem about the sea.")

    rows = wait_for(
        lambda: len(r := [x for x in table_rows(page) if int(x["seq_id"]) >= 0]) == 2 and r,
        60,
        "two live sequences in the table",
    )
    live_seqs = {int(r["seq_id"]) for r in rows}
    wait_for(lambda: live_seqs <= drawn_seqs(page), 10, "both sequences drawn on the map")
    page.save_screenshot(str(artifacts_dir / "web_two_sequences.png"))
    assert counter_int(page, "total-used") > 0

    wait_reply_done(page)
    background.join(60)
    cells = wait_idle(live_server.url)
    wait_for(lambda: table_rows(page) == [], 10, "the table to empty")
    owners = set(decode_runs(cells["owner_runs"]).tolist())
    # what stays: prefix-cache holders, and cells only the prefix index holds (HELD)
    assert owners <= {FREE, SHARED, HELD, *cells["holder_seq_ids"]}
    assert not live_seqs & drawn_seqs(page) - set(cells["holder_seq_ids"])


def test_stop_button_aborts_the_request(page, live_server):
    set_generation(page, max_tokens=400, ignore_eos=True)
    ask(page, "Tell me a very long story about a lighthouse keeper.")
    wait_for(lambda: last_reply(page)["text"].strip(), 60, "the first tokens")
    slots = get_json(live_server.url, "/slots")
    assert len(slots) == 1
    page.find_element(By.ID, "stop").click()

    wait_for(lambda: get_json(live_server.url, "/slots") == [], 10, "the request to leave /slots")
    reply = wait_reply_done(page, 10)
    assert "stopped" in reply["classes"] and reply["meta"] == "stopped"
    assert page.find_element(By.ID, "send").is_enabled()


def metric_values(text: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_map_counts_equal_the_metrics_when_idle(live_server):
    cells = wait_idle(live_server.url)
    metrics = metric_values(httpx.get(live_server.url + "/metrics").text)
    assert get_json(live_server.url, "/v1/cache/cells") == cells  # idle: nothing moved
    totals = cells["totals"]
    assert metrics["cellserve_kv_cells_total"] == cells["n_cells"]
    assert metrics["cellserve_kv_cells_used"] == totals["used"]
    assert metrics["cellserve_kv_cells_shared"] == totals["shared"]
    assert metrics["cellserve_kv_cells_cached"] == totals["cached"]
    assert totals["used"] + totals["free"] == cells["n_cells"]
    prefix = cells["prefix_cache"]
    assert metrics["cellserve_prefix_cache_hit_tokens_total"] == prefix["hit_tokens"]
    assert metrics["cellserve_prefix_cache_queried_tokens_total"] == prefix["queried_tokens"]
    assert metrics["cellserve_context_shifts_total"] == cells["num_context_shifts"]
    assert metrics["cellserve_preemptions_total"] == cells["num_preemptions"]


def test_page_behind_an_api_key(browser, live_server, monkeypatch):
    state = live_server.app.state
    monkeypatch.setattr(
        state, "settings", state.settings.model_copy(update={"api_key": SecretStr(KEY)})
    )
    assert httpx.get(live_server.url + "/v1/cache/cells").status_code == 401
    browser.get(live_server.url + "/")
    wait_for(lambda: browser.execute_script("return document.getElementById('key-dialog').open"))
    browser.find_element(By.ID, "key-input").send_keys(KEY)
    browser.find_element(By.ID, "key-submit").click()

    wait_for(lambda: counter(browser, "total-free") != "–", 10, "the map behind the key")
    set_generation(browser, max_tokens=6, ignore_eos=True)
    ask(browser, "Hello!")
    reply = wait_reply_done(browser)
    assert reply["text"].strip() and "failed" not in reply["classes"]
    browser.get("about:blank")
