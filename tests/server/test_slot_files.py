"""llama.cpp's slot save/restore through the real server (server/routes_slots.py) on tiny
random models: a conversation saved by one server process is restored by another and its next
turn is a prefix hit over the whole conversation with the same greedy text as on the process
that saved it; on a sliding-window model (Gemma 3) too. File names cannot leave the folder;
damaged files, another model's files and another cache layout are refused with nothing
restored; without --slot-save-path save/restore are 501."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from kvcache.cell_file import GroupRows, read_cell_file, write_cell_file
from tests.live_server import start_server
from tests.tiny_models import write_tiny_gemma3, write_tiny_llama

PROMPT = " ".join(f"word{i} and more" for i in range(40))


def complete(url: str, prompt: str | list[int] = PROMPT) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    body |= {"logprobs": 1, "return_tokens_as_token_ids": True}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def cached_slots(url: str) -> list[dict]:
    return httpx.get(f"{url}/slots/cached").json()


def slot(url: str, sid: int, action: str, filename: str | None = None) -> httpx.Response:
    body = {} if filename is None else {"filename": filename}
    return httpx.post(f"{url}/slots/{sid}", params={"action": action}, json=body, timeout=60)


def serve(folder: Path, slot_dir: Path | None):  # noqa: ANN201
    return start_server(
        model=str(folder),
        n_cells=1024,
        n_seq_max=4,
        dtype="float32",
        batch_invariant=True,
        slot_save_path=None if slot_dir is None else str(slot_dir),
    )


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_saved_conversation_restores_in_a_new_process(tmp_path: Path, family: str) -> None:
    writer = write_tiny_llama if family == "llama" else write_tiny_gemma3
    folder = writer(tmp_path / family)
    slots_dir = tmp_path / "slots"
    first = serve(folder, slots_dir)
    try:
        cold = complete(first.url)
        cached = httpx.get(f"{first.url}/slots/cached").json()
        assert len(cached) == 1
        sid, n = cached[0]["id_slot"], cached[0]["n_tokens"]
        assert n >= cold["usage"]["prompt_tokens"]
        saved = slot(first.url, sid, "save", "conv.bin")
        assert saved.status_code == 200, saved.text
        body = saved.json()
        assert body["n_saved"] == n and body["filename"] == "conv.bin"
        assert body["n_written"] == (slots_dir / "conv.bin").stat().st_size
        assert body["timings"]["save_ms"] > 0
        ids = httpx.post(f"{first.url}/tokenize", json={"content": PROMPT}).json()["tokens"]
        out = [int(t.removeprefix("token_id:")) for t in cold["choices"][0]["logprobs"]["tokens"]]
        live = complete(first.url, ids + out + [ids[3]])  # from the live holder
        assert live["usage"]["prompt_tokens_details"]["cached_tokens"] >= n
    finally:
        first.stop()
    # the conversation's next turn: the slot holds the prompt and 7 of the 8 tokens after it
    # (a repeat of the prompt alone would need Gemma 3's window of 8 rows before the
    # slot's end, which neither the live holder nor the file keeps)
    second = serve(folder, slots_dir)
    try:
        restored = slot(second.url, 2, "restore", "conv.bin")
        assert restored.status_code == 200, restored.text
        assert restored.json()["n_restored"] == n
        assert httpx.get(f"{second.url}/slots/cached").json()[0]["id_slot"] == 2
        warm = complete(second.url, ids + out + [ids[3]])
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= n
        assert warm["choices"][0]["text"] == live["choices"][0]["text"]
        # the continuation's holder (on Llama it covers the restored one, which it replaced;
        # a window's holder serves only its own length, so Gemma 3 keeps both)
        held = {h["n_tokens"]: h["id_slot"] for h in cached_slots(second.url)}
        m = len(ids) + len(out) + 1 + 8 - 1
        assert set(held) == ({m} if family == "llama" else {n, m})
        erased = slot(second.url, held[m], "erase")
        assert erased.json() == {"id_slot": held[m], "n_erased": m}
    finally:
        second.stop()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    root = tmp_path_factory.mktemp("slots")
    server = serve(write_tiny_llama(root / "llama"), root / "slots")
    complete(server.url)
    yield server, root / "slots"
    server.stop()


@pytest.mark.parametrize(
    "name", ["../escape.bin", "a/b.bin", "/tmp/abs.bin", ".hidden", "..", "", "x" * 300]
)
def test_file_names_stay_inside_the_folder(live, name: str) -> None:  # noqa: ANN001
    server, folder = live
    sid = httpx.get(f"{server.url}/slots/cached").json()[0]["id_slot"]
    for action in ("save", "restore"):
        resp = slot(server.url, sid, action, name)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["type"] == "invalid_request_error"
    assert not (folder.parent / "escape.bin").exists() and not Path("/tmp/abs.bin").exists()


def test_refused_files_restore_nothing(live) -> None:  # noqa: ANN001
    server, folder = live
    url = server.url
    sid = httpx.get(f"{url}/slots/cached").json()[0]["id_slot"]
    assert slot(url, sid, "save", "good.bin").status_code == 200
    good = folder / "good.bin"
    data, _ = read_cell_file(good, server.app.state.backend.model_fingerprint)
    raw = good.read_bytes()
    (folder / "torn.bin").write_bytes(raw[: len(raw) - 100])
    (folder / "noise.bin").write_bytes(b"not a slot file at all")
    data.model = "0" * 64
    write_cell_file(folder / "other-model.bin", data)
    data.model = server.app.state.backend.model_fingerprint
    # rows in another cache type than this server's (its default is 16-bit: make them f32)
    other = torch.float32 if data.groups[0].k.dtype != torch.float32 else torch.bfloat16
    data.groups = [GroupRows(g.positions, g.k.to(other), g.v.to(other)) for g in data.groups]
    write_cell_file(folder / "bf16.bin", data)
    before = httpx.get(f"{url}/slots/cached").json()
    for name, words in [
        ("torn.bin", "truncated"),
        ("noise.bin", "not a cellserve slot file"),
        ("other-model.bin", "different model"),
        ("bf16.bin", "layout"),
    ]:
        resp = slot(url, 3, "restore", name)
        assert resp.status_code == 400, resp.text
        assert words in resp.json()["error"]["message"]
    missing = slot(url, 3, "restore", "missing.bin")
    assert missing.status_code == 404
    assert httpx.get(f"{url}/slots/cached").json() == before
    assert slot(url, sid, "explode").status_code == 400
    empty = slot(url, 3, "save", "empty.bin")
    assert empty.status_code == 400 and "no cached prompt" in empty.json()["error"]["message"]
    assert slot(url, 99, "erase").status_code == 400
    cells = httpx.get(f"{url}/v1/cache/cells").json()
    held = sum(h["n_tokens"] for h in httpx.get(f"{url}/slots/cached").json())
    assert cells["num_running"] == 0 and cells["totals"]["used"] == held  # nothing leaked


def test_without_a_folder_save_and_restore_are_501(tmp_path: Path) -> None:
    server = serve(write_tiny_llama(tmp_path / "llama"), None)
    try:
        complete(server.url)
        sid = httpx.get(f"{server.url}/slots/cached").json()[0]["id_slot"]
        for action in ("save", "restore"):
            resp = slot(server.url, sid, action, "x.bin")
            assert resp.status_code == 501
            assert "--slot-save-path" in resp.json()["error"]["message"]
        assert slot(server.url, sid, "erase").json()["n_erased"] > 0
    finally:
        server.stop()
