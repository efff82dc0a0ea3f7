"""Slot files and the disk tier on recurrent and hybrid models, through the real server on tiny
random Mamba2, Granite 4.0-H (Mamba2 layers beside attention layers), LFM2 and Falcon-H1
(attention and Mamba2 in every layer) folders: a conversation saved by one process (`POST
/slots/{id}?action=save`, or `--cache-dir` as it finishes) is restored by another, and its
continuation is a prefix hit over the whole conversation with the same greedy text and
log-probabilities as on the process that computed it; the disk tier keeps the states the prompt
steps checkpointed too, so a repeated prompt is a hit after a restart. The file holds the
recurrent layers' state after the last token beside the attention layers' K/V rows; a file
without that state is refused with nothing restored."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvcache.cell_file import read_cell_file, write_cell_file
from tests.live_server import start_server
from tests.tiny_ssm import (
    write_tiny_falcon_h1,
    write_tiny_granite_hybrid,
    write_tiny_lfm2,
    write_tiny_mamba2,
)

PROMPT = [(7 * i) % 280 + 20 for i in range(90)]  # the tiny tokenizer has 320 tokens
MORE = [(11 * i) % 280 + 30 for i in range(12)]
# the model's vocabulary is the tokenizer's (generated ids make valid prompts); states that
# remember the whole conversation, so that a lost or zeroed one changes the logprobs
WRITERS = {
    "mamba2": lambda folder: write_tiny_mamba2(folder, vocab=320, long_memory=True),
    "granite_hybrid": lambda folder: write_tiny_granite_hybrid(folder, vocab=320, long_memory=True),
    "lfm2": lambda folder: write_tiny_lfm2(folder, vocab=320),  # short convolutions: no ssm
    # attention and Mamba2 in every layer: each layer's K/V rows and its state in one file
    "falcon_h1": lambda folder: write_tiny_falcon_h1(folder, vocab=320, long_memory=True),
}


def complete(url: str, prompt: list[int]) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
    }
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def token_ids(reply: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in reply["choices"][0]["logprobs"]["tokens"]]


def assert_same_output(a: dict, b: dict) -> None:
    """The same tokens with the same log-probabilities (a zeroed or stale state moves them by
    ~1e-2 on these models; a cached prefix against a recomputed one by < 1e-5)."""
    la, lb = (r["choices"][0]["logprobs"] for r in (a, b))
    assert la["tokens"] == lb["tokens"]
    assert la["token_logprobs"] == pytest.approx(lb["token_logprobs"], abs=1e-4)


def slot(url: str, sid: int, action: str, filename: str) -> httpx.Response:
    body = {"filename": filename}
    return httpx.post(f"{url}/slots/{sid}", params={"action": action}, json=body, timeout=60)


def serve(folder: Path, **kw: object):  # noqa: ANN201
    return start_server(
        model=str(folder), n_cells=1024, n_seq_max=4, dtype="float32", batch_invariant=True, **kw
    )


def held(url: str) -> list[dict]:
    return httpx.get(f"{url}/slots/cached").json()


@pytest.mark.parametrize("family", list(WRITERS))
def test_a_saved_state_restores_in_a_new_process(tmp_path: Path, family: str) -> None:
    folder = WRITERS[family](tmp_path / family)
    slots_dir = tmp_path / "slots"
    first = serve(folder, slot_save_path=str(slots_dir))
    try:
        cold = complete(first.url, PROMPT)
        ((sid, n),) = [(h["id_slot"], h["n_tokens"]) for h in held(first.url)]
        conversation = PROMPT + token_ids(cold)
        assert n == len(conversation) - 1  # the last token sampled, never consumed
        saved = slot(first.url, sid, "save", "conv.bin")
        assert saved.status_code == 200, saved.text
        assert saved.json()["n_saved"] == n
        data, _ = read_cell_file(slots_dir / "conv.bin", first.app.state.backend.model_fingerprint)
        states = [g for g in data.groups if g.positions.tolist() == [n - 1]]
        assert states, "the recurrent layers' state after the last token"
        assert any(float(g.k.abs().sum() + g.v.abs().sum()) > 0 for g in states)
        live = complete(first.url, conversation + MORE)  # from the live holder
        assert live["usage"]["prompt_tokens_details"]["cached_tokens"] >= n
    finally:
        first.stop()
    second = serve(folder, slot_save_path=str(slots_dir))
    try:
        restored = slot(second.url, 2, "restore", "conv.bin")
        assert restored.status_code == 200, restored.text
        assert restored.json()["n_restored"] == n
        warm = complete(second.url, conversation + MORE)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= n
        assert_same_output(warm, live)
        # the same continuation computed from scratch here: the restored state was exact
        assert slot(second.url, 2, "erase", "conv.bin").status_code == 200
        for h in held(second.url):
            assert slot(second.url, h["id_slot"], "erase", "x").status_code == 200
        scratch = complete(second.url, conversation + MORE)
        assert scratch["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert_same_output(scratch, warm)
    finally:
        second.stop()


def test_a_file_without_the_state_restores_nothing(tmp_path: Path) -> None:
    folder = WRITERS["granite_hybrid"](tmp_path / "hybrid")
    slots_dir = tmp_path / "slots"
    server = serve(folder, slot_save_path=str(slots_dir))
    try:
        complete(server.url, PROMPT)
        ((sid, n),) = [(h["id_slot"], h["n_tokens"]) for h in held(server.url)]
        assert slot(server.url, sid, "save", "good.bin").status_code == 200
        fingerprint = server.app.state.backend.model_fingerprint
        data, _ = read_cell_file(slots_dir / "good.bin", fingerprint)
        for g in data.groups:  # drop the state: the positions the recurrent group keeps
            if g.positions.tolist() == [n - 1] and g.k.shape[2] == 1:
                g.positions = g.positions[:0]
                g.k, g.v = g.k[:, :, :0], g.v[:, :, :0]
        write_cell_file(slots_dir / "stateless.bin", data)
        before = held(server.url)
        used = httpx.get(f"{server.url}/v1/cache/cells").json()["totals"]["used"]
        resp = slot(server.url, 3, "restore", "stateless.bin")
        assert resp.status_code == 400, resp.text
        assert "lacks the rows of its last position" in resp.json()["error"]["message"]
        assert held(server.url) == before
        assert httpx.get(f"{server.url}/v1/cache/cells").json()["totals"]["used"] == used
        # an attention row missing in the middle: found once placed, the slot left empty
        data, _ = read_cell_file(slots_dir / "good.bin", fingerprint)
        for g in data.groups:
            if g.k.shape[2] == n:
                keep = [p for p in range(n) if p != n // 2]
                g.positions, g.k, g.v = g.positions[keep], g.k[:, :, keep], g.v[:, :, keep]
        write_cell_file(slots_dir / "holed.bin", data)
        resp = slot(server.url, 3, "restore", "holed.bin")
        assert resp.status_code == 400, resp.text
        assert "lacks the rows of 1 positions" in resp.json()["error"]["message"]
        assert held(server.url) == before
        assert httpx.get(f"{server.url}/v1/cache/cells").json()["totals"]["used"] == used
    finally:
        server.stop()


@pytest.mark.parametrize("family", list(WRITERS))
def test_a_conversation_seen_before_a_restart_continues_from_disk(
    tmp_path: Path, family: str
) -> None:
    folder = WRITERS[family](tmp_path / family)
    cache = tmp_path / "cache"
    first = serve(folder, cache_dir=str(cache), cache_tier_min_tokens=16)
    try:
        cold = complete(first.url, PROMPT)
        conversation = PROMPT + token_ids(cold)
        n = len(conversation) - 1
        live = complete(first.url, conversation + MORE)
    finally:
        first.stop()
    # both conversations, and the states each prompt step kept (before its last token)
    assert len(list(cache.glob("*.cells"))) == 4
    second = serve(folder, cache_dir=str(cache), cache_tier_min_tokens=16)
    try:
        warm = complete(second.url, conversation + MORE)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= n
        assert_same_output(warm, live)
        # the first prompt again: its state before the last token came back too
        again = complete(second.url, PROMPT)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) - 1
        assert_same_output(again, cold)
        # an entry serves only prompts that extend all of it (a state after its last token)
        other = complete(second.url, PROMPT[:60] + MORE)
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        second.stop()
