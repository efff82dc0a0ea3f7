"""LoRA adapters loaded and unloaded while the server runs (server/lora_runtime.py, vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter): a loaded adapter is served as a start-up
one is, a failed load changes nothing, an unloaded one is gone but its running requests finish
with it, and K/V cached under it never serves the adapter loaded after it."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from cli.main import build_settings, make_parser
from scheduler.prefix_cache import uses_adapter
from scheduler.scheduler import Scheduler
from server.settings import Settings
from tests.live_server import LiveServer, start_server
from tests.server.test_lora_server import ALL_PROJ, PROMPT, complete, text
from tests.tiny_lora import write_peft_adapter
from tests.tiny_models import write_tiny_llama

pytest.importorskip("peft")

TINY = {"served_model_name": "tiny", "n_cells": 2048, "n_seq_max": 8, "n_batch": 256}
TINY |= {"dtype": "float32", "quant": "none"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-runtime")
    base = write_tiny_llama(root / "tiny")
    other = write_tiny_llama(root / "wide", dim=96, hidden_dim=160)
    return {
        "base": base,
        "pirate": write_peft_adapter(base, root / "pirate", seed=1, targets=ALL_PROJ),
        "poet": write_peft_adapter(base, root / "poet", seed=2, targets=["q_proj", "v_proj"], r=8),
        "wide": write_peft_adapter(other, root / "wide-lora", seed=3, targets=["q_proj"]),
    }


@pytest.fixture(scope="module")
def startup(folders: dict[str, Path]) -> LiveServer:
    """The same adapters given at start-up, without --allow-runtime-lora."""
    lora = [f"pirate={folders['pirate']}", f"poet={folders['poet']}"]
    live = start_server(model=str(folders["base"]), lora=lora, lora_init_without_apply=True, **TINY)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def runtime(folders: dict[str, Path]) -> LiveServer:
    """--allow-runtime-lora and no adapter at start-up."""
    slots = str(folders["base"].parent / "slots")
    live = start_server(
        model=str(folders["base"]), allow_runtime_lora=True, slot_save_path=slots, **TINY
    )
    yield live
    live.stop()


def load(url: str, name: str, path: Path | str, **extra: object) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)} | extra
    return httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=120)


def unload(url: str, name: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=120)


def adapters(url: str) -> dict[str, dict]:
    return {a["name"]: a for a in httpx.get(f"{url}/lora-adapters").json()}


def models(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}


def attached_ids(server: LiveServer) -> set[int]:
    """The adapter ids whose weights the model carries."""
    return set(server.app.state.backend.lora_runtime.worker.lora.by_id)


def test_a_loaded_adapter_serves_as_a_startup_one(
    runtime: LiveServer, startup: LiveServer, folders: dict[str, Path]
) -> None:
    url = runtime.url
    plain = text(url)
    resp = load(url, "pirate", folders["pirate"])
    assert resp.status_code == 200, resp.text
    try:
        assert "pirate" in resp.text
        aid = adapters(url)["pirate"]["id"]
        assert adapters(url)["pirate"]["scale"] == 0.0  # the base model's replies stay
        assert models(url)["pirate"]["parent"] == "tiny"
        pirate = text(startup.url, model="pirate")
        assert text(url, model="pirate") == pirate != plain
        assert text(url, model="tiny:pirate") == pirate
        assert text(url, lora=[{"id": aid, "scale": 1.0}]) == pirate
        assert text(url) == plain
        # a second load packs both: the first serves the same tokens
        assert load(url, "poet", folders["poet"]).status_code == 200
        assert text(url, model="poet") == text(startup.url, model="poet")
        assert text(url, model="pirate") == pirate
        assert unload(url, "poet").status_code == 200
    finally:
        unload(url, "pirate")


def test_a_failed_load_changes_nothing(runtime: LiveServer, folders: dict[str, Path]) -> None:
    url = runtime.url
    assert load(url, "pirate", folders["pirate"]).status_code == 200
    try:
        before = (adapters(url), models(url), attached_ids(runtime))
        cases = [
            ("wide", folders["wide"], "do not fit the base weight"),
            ("pirate", folders["poet"], "already been loaded"),
            ("tiny", folders["poet"], "the base model's name"),
            ("", folders["poet"], "must be given"),
        ]
        for name, path, why in cases:
            resp = load(url, name, path)
            assert resp.status_code == 400, (name, resp.text)
            err = resp.json()["error"]
            assert why in err["message"] and err["type"] == "invalid_request_error"
        # a path that is not there: vLLM's 404 NotFoundError, in the API's error shape
        resp = load(url, "gone", folders["base"] / "no-such-adapter")
        assert resp.status_code == 404, resp.text
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "not_found_error" and err["code"] == "lora_not_found"
        assert err["param"] == "lora_path" and "no such file or folder" in err["message"]
        assert (adapters(url), models(url), attached_ids(runtime)) == before
    finally:
        unload(url, "pirate")


def test_a_load_that_fails_while_attaching_keeps_the_adapters_served(
    runtime: LiveServer, folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = runtime.url
    assert load(url, "pirate", folders["pirate"]).status_code == 200
    try:
        pirate = text(url, model="pirate")
        before = (adapters(url), attached_ids(runtime))

        def no_memory(*_: object) -> None:
            raise RuntimeError("out of memory")

        monkeypatch.setattr("model.layers.lora.LoraLinear.pack", no_memory)
        resp = load(url, "poet", folders["poet"])
        monkeypatch.undo()
        assert resp.status_code == 500 and "out of memory" in resp.json()["error"]["message"]
        assert (adapters(url), attached_ids(runtime)) == before
        assert text(url, model="pirate") == pirate
    finally:
        unload(url, "pirate")


def test_an_unloaded_adapter_is_gone(runtime: LiveServer, folders: dict[str, Path]) -> None:
    url = runtime.url
    assert load(url, "pirate", folders["pirate"]).status_code == 200
    aid = adapters(url)["pirate"]["id"]
    resp = unload(url, "pirate")
    assert resp.status_code == 200, resp.text
    assert "pirate" not in adapters(url) and "pirate" not in models(url)
    resp = complete(url, model="pirate")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    resp = complete(url, lora=[{"id": aid, "scale": 1.0}])
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "lora"
    assert aid not in attached_ids(runtime)
    resp = unload(url, "pirate")
    assert resp.status_code == 404 and "cannot be found" in resp.json()["error"]["message"]


def test_a_running_request_finishes_with_its_unloaded_adapter(
    runtime: LiveServer, folders: dict[str, Path]
) -> None:
    url = runtime.url
    assert load(url, "pirate", folders["pirate"]).status_code == 200
    aid = adapters(url)["pirate"]["id"]
    body = {"model": "pirate", "max_tokens": 200}
    alone = text(url, **body)
    payload = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True, "stream": True} | body
    pieces = []
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if not pieces:  # running: unload under it
                assert unload(url, "pirate").status_code == 200
                assert aid in attached_ids(runtime)  # kept for the request
            pieces.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(pieces) == alone
    # the next change drops the weights no request uses any more
    assert load(url, "poet", folders["poet"]).status_code == 200
    assert aid not in attached_ids(runtime)
    assert unload(url, "poet").status_code == 200


def test_no_prefix_cache_reuse_across_a_reloaded_name(
    runtime: LiveServer, startup: LiveServer, folders: dict[str, Path]
) -> None:
    url = runtime.url

    def cached(resp: httpx.Response) -> int:
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert load(url, "x", folders["pirate"]).status_code == 200
    first = adapters(url)["x"]["id"]
    complete(url, model="x")
    assert cached(complete(url, model="x")) > 0  # the cache works under one adapter
    assert unload(url, "x").status_code == 200
    assert load(url, "x", folders["poet"]).status_code == 200
    try:
        assert adapters(url)["x"]["id"] > first  # ids are never reused
        resp = complete(url, model="x")
        assert cached(resp) == 0
        assert resp.json()["choices"][0]["text"] == text(startup.url, model="poet")
    finally:
        unload(url, "x")


def cached_under(server: LiveServer, aid: int) -> int:
    """Prefix-cache holders and prefix-index nodes computed under adapter `aid`."""

    def count(sched: Scheduler, _: object) -> int:
        holders = [s for s in sched.prefix.seq_ids if uses_adapter(sched.prefix.lora(s), aid)]
        radix = sched.seq_ids.radix
        nodes = [] if radix is None else [n for n in radix.nodes() if uses_adapter(n.lora, aid)]
        return len(holders) + len(nodes)

    return server.app.state.backend.engine.call(count)


def test_an_unloaded_adapters_prefix_cache_is_freed_at_once(
    runtime: LiveServer, folders: dict[str, Path]
) -> None:
    url = runtime.url
    assert load(url, "x", folders["pirate"]).status_code == 200
    aid = adapters(url)["x"]["id"]
    assert complete(url, model="x").status_code == 200
    assert complete(url).status_code == 200  # the base model's entry stays
    assert cached_under(runtime, aid) > 0
    assert unload(url, "x").status_code == 200
    assert cached_under(runtime, aid) == 0
    resp = complete(url)
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_load_inplace_serves_new_weights_under_the_name(
    runtime: LiveServer, startup: LiveServer, folders: dict[str, Path]
) -> None:
    """vLLM's load_inplace: the name moves to the new weights under a new id (the prefix
    cache never serves the old K/V), and the old id goes as an unload's would."""
    url = runtime.url
    assert load(url, "x", folders["pirate"]).status_code == 200
    try:
        first = adapters(url)["x"]["id"]
        assert text(url, model="x") == text(startup.url, model="pirate")
        resp = load(url, "x", folders["poet"])
        assert resp.status_code == 400 and "load_inplace" in resp.json()["error"]["message"]
        # a failed reload leaves the adapter serving its weights
        for path in (folders["wide"], folders["base"] / "no-such-adapter"):
            assert load(url, "x", path, load_inplace=True).status_code in (400, 404)
            assert adapters(url)["x"]["id"] == first and attached_ids(runtime) == {first}
        resp = load(url, "x", folders["poet"], load_inplace=True)
        assert resp.status_code == 200, resp.text
        second = adapters(url)["x"]["id"]
        assert second > first and attached_ids(runtime) == {second}
        assert cached_under(runtime, first) == 0
        assert [m for m in models(url) if m == "x"] == ["x"]
        resp = complete(url, model="x")
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert resp.json()["choices"][0]["text"] == text(startup.url, model="poet")
        # load_inplace for a name not served is a plain load
        assert load(url, "y", folders["pirate"], load_inplace=True).status_code == 200
        assert unload(url, "y").status_code == 200
    finally:
        unload(url, "x")


def test_a_slot_under_a_runtime_adapter_is_not_saved(
    runtime: LiveServer, folders: dict[str, Path]
) -> None:
    """A slot file names adapters by id: a runtime one's may be another's after a restart."""
    url = runtime.url
    assert load(url, "x", folders["pirate"]).status_code == 200
    try:
        for i, body in enumerate([{"model": "x"}, {}]):
            assert complete(url, prompt=f"Slot {i}: {PROMPT}", **body).status_code == 200
            cached = httpx.get(f"{url}/slots/cached").json()
            sid = max((c for c in cached if c["source"] == "slot"), key=lambda c: c["last_used"])
            resp = httpx.post(
                f"{url}/slots/{sid['id_slot']}",
                params={"action": "save"},
                json={"filename": f"slot{i}.bin"},
                timeout=60,
            )
            assert resp.status_code == (400 if body else 200), resp.text
    finally:
        unload(url, "x")


def test_the_endpoints_refuse_when_off(startup: LiveServer, folders: dict[str, Path]) -> None:
    for resp in (load(startup.url, "again", folders["pirate"]), unload(startup.url, "pirate")):
        assert resp.status_code == 404
        assert "--allow-runtime-lora" in resp.json()["error"]["message"]
    assert set(adapters(startup.url)) == {"pirate", "poet"}


def test_the_flag_and_vllms_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not build_settings(make_parser().parse_args(["serve"])).allow_runtime_lora
    args = make_parser().parse_args(["serve", "--allow-runtime-lora"])
    assert build_settings(args).allow_runtime_lora
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert Settings().allow_runtime_lora
    with pytest.raises(ValueError, match="--allow-runtime-lora"):
        Settings(models=["a=b", "c=d"])
