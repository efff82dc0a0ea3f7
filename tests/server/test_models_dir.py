"""Several models in one server (server/model_router.py, llama.cpp's router mode) with fake
backends: discovery, load on first use, LRU unload under --models-max, /models/load and
/models/unload, per-model status and metrics, and the errors."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from pathlib import Path

import gguf
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cli.main import build_settings, main, make_parser
from server.backend import Backend
from server.model_router import ModelRouter
from server.models_dir import model_sources, scan_models_dir
from server.settings import Settings
from tests.live_server import LiveServer
from tests.server.fake_engine import FakeEngine, FakeTemplate, FakeTokenizer


def write_gguf_header(path: Path, arch: str = "llama") -> None:
    """A GGUF file with only its header: what a load checks before it makes room
    (server/model_check.py); FakeModels loads the rest."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def make_models_dir(root: Path, names: tuple[str, ...] = ("alpha", "beta")) -> Path:
    folder = root / "models"
    folder.mkdir()
    for name in names:
        write_gguf_header(folder / f"{name}.gguf")
    return folder


class FakeModels:
    """A BackendFactory: each model a FakeEngine that answers "I am <name>."; `slow` models
    take `load_s` to load, `broken` ones fail; `engines` keeps weak references."""

    def __init__(self, broken: tuple[str, ...] = (), slow: tuple[str, ...] = (), **engine):
        self.broken, self.slow, self.engine = broken, slow, engine
        self.failure: type[Exception] = ValueError  # what a broken model's load raises
        self.loads: list[str] = []
        self.engines: list[weakref.ref[FakeEngine]] = []
        self.load_s = 1.5

    def __call__(self, settings: Settings, on_step) -> Backend:
        name = settings.served_model_name
        assert name is not None and settings.model is not None
        if name in self.broken:
            raise self.failure(f"{settings.model}: not a GGUF file")
        if name in self.slow:
            time.sleep(self.load_s)
        self.loads.append(name)
        engine = FakeEngine(reply=f"I am {name}.", **self.engine)
        self.engines.append(weakref.ref(engine))
        return Backend(
            engine=engine,
            tokenizer=FakeTokenizer(),
            chat_template=FakeTemplate(),
            model_name=name,
            n_ctx_seq=settings.ctx_per_seq,
            n_cells=settings.n_cells,
            cache_bytes=0,
        )


def chat(url: str, model: str | None, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64} | extra
    if model is not None:
        body["model"] = model
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def statuses(url: str) -> dict[str, str]:
    resp = httpx.get(f"{url}/v1/models", timeout=10)
    assert resp.status_code == 200, resp.text
    return {m["id"]: m["status"]["value"] for m in resp.json()["data"]}


def wait_status(url: str, model: str, value: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while statuses(url)[model] != value:
        assert time.monotonic() < deadline, f"{model} never became {value}: {statuses(url)}"
        time.sleep(0.02)


def model_metrics(url: str) -> dict[tuple[str, str], float]:
    """(sample name, model label) -> value of the cellserve_model_* samples."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("cellserve_model_") and "status" not in s.labels:
                out[(s.name, s.labels["model"])] = s.value
    return out


@pytest.fixture
def start(server_factory, tmp_path):
    def start(models: FakeModels, **settings) -> LiveServer:
        settings.setdefault("models_dir", str(make_models_dir(tmp_path)))
        return server_factory(models, **settings)

    return start


def test_models_dir_lists_ggufs_and_folders_by_name(tmp_path: Path) -> None:
    folder = make_models_dir(tmp_path, ("alpha", "mmproj-alpha-f16"))
    (folder / "big-00001-of-00002.gguf").write_bytes(b"GGUF")
    (folder / "big-00002-of-00002.gguf").write_bytes(b"GGUF")
    (folder / "hf-model").mkdir()
    (folder / "hf-model" / "config.json").write_text("{}")
    (folder / "an-adapter").mkdir()
    (folder / "an-adapter" / "config.json").write_text("{}")
    (folder / "an-adapter" / "adapter_config.json").write_text("{}")
    (folder / "gguf-folder").mkdir()
    (folder / "gguf-folder" / "model-q4_k_m.gguf").write_bytes(b"GGUF")
    (folder / "notes.txt").write_text("not a model")
    found = {s.name: Path(s.path).relative_to(folder) for s in scan_models_dir(str(folder))}
    assert found == {
        "alpha": Path("alpha.gguf"),
        "big": Path("big-00001-of-00002.gguf"),
        "gguf-folder": Path("gguf-folder/model-q4_k_m.gguf"),
        "hf-model": Path("hf-model"),
    }


def test_flags_pick_router_mode_and_refuse_what_it_cannot_do(tmp_path: Path, capsys) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF")
    b.write_bytes(b"GGUF")
    parse = make_parser().parse_args
    single = build_settings(parse(["serve", "--model", str(a)]))
    assert single.model == str(a) and not single.router_mode
    two = build_settings(
        parse(["serve", "--model", f"x={a}", "--model", f"y={b}", "--models-max", "1"])
    )
    assert two.router_mode and two.models_max == 1 and two.models_autoload
    off = build_settings(parse(["serve", "--models-dir", str(tmp_path), "--no-models-autoload"]))
    assert not off.models_autoload
    assert [(s.name, s.path) for s in model_sources(two)] == [("x", str(a)), ("y", str(b))]
    with pytest.raises(ValueError, match="two models with one name"):
        model_sources(Settings(models=[f"x={a}", f"x={b}"]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no GGUF file or model folder"):
        model_sources(Settings(models_dir=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="--lora: not supported with several models"):
        Settings(models_dir=str(tmp_path), lora=["adapter"])
    assert main(["serve", "--models-dir", str(tmp_path / "nowhere")]) == 2
    assert "--models-dir" in capsys.readouterr().err
    assert main(["serve", "--models-dir", str(tmp_path), "--lora", "x"]) == 2
    err = capsys.readouterr().err
    assert err == "cellserve serve: --lora: not supported with several models (--models-dir)\n"


def test_alternating_requests_with_models_max_1_load_and_unload(start) -> None:
    models = FakeModels()
    server = start(models, models_max=1)
    assert statuses(server.url) == {"alpha": "unloaded", "beta": "unloaded"}
    for name in ["alpha", "beta", "alpha", "beta", "beta"]:
        resp = chat(server.url, name)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == name
        assert resp.json()["choices"][0]["message"]["content"] == f"I am {name}."
    assert models.loads == ["alpha", "beta", "alpha", "beta"]
    assert statuses(server.url) == {"alpha": "unloaded", "beta": "loaded"}
    m = model_metrics(server.url)
    assert m[("cellserve_model_loads_total", "alpha")] == 2
    assert m[("cellserve_model_loads_total", "beta")] == 2
    assert m[("cellserve_model_unloads_total", "alpha")] == 2
    assert m[("cellserve_model_unloads_total", "beta")] == 1
    gc.collect()
    # an unloaded model's engine is gone: nothing holds it any more
    assert [ref() is None for ref in models.engines] == [True, True, True, False]


def test_a_loading_model_holds_its_requests_not_the_others(start) -> None:
    models = FakeModels(slow=("beta",))
    server = start(models, models_max=2)
    assert chat(server.url, "alpha").status_code == 200
    slow: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: slow.append(chat(server.url, "beta")))
    waiter.start()
    wait_status(server.url, "beta", "loading")
    assert chat(server.url, "alpha").status_code == 200
    assert statuses(server.url)["beta"] == "loading"
    waiter.join(timeout=30)
    assert slow[0].status_code == 200 and slow[0].json()["model"] == "beta"


def test_a_busy_model_cannot_keep_another_from_loading(tmp_path: Path) -> None:
    """alpha is never idle (each holder takes it before the last lets go), yet beta loads: alpha
    finishes what it holds, takes nothing new (its new requests wait), and is unloaded."""
    settings = Settings(models_dir=str(make_models_dir(tmp_path)), models_max=1)
    router = ModelRouter(settings, model_sources(settings), FakeModels(), lambda step: None)
    alpha, beta = router.entries["alpha"], router.entries["beta"]

    async def hold_alpha(seconds: float) -> None:
        await router.acquire(alpha)
        await asyncio.sleep(seconds)
        router.release(alpha)

    async def scenario() -> tuple[bool, list[str]]:
        await hold_alpha(0)  # loaded
        relay = [asyncio.create_task(hold_alpha(0.2))]
        beta_task = None
        # overlapping holders every 0.1 s for as long as beta waits (at most 30 s): a router that
        # waited for alpha to be idle would never load beta while the relay runs
        while len(relay) < 300 and (beta_task is None or not beta_task.done()):
            await asyncio.sleep(0.1)
            relay.append(asyncio.create_task(hold_alpha(0.2)))
            if len(relay) == 3:
                beta_task = asyncio.create_task(router.acquire(beta))
        loaded_during_relay = beta_task.done()
        await beta_task
        router.release(beta)
        await asyncio.gather(*relay)
        await router.close()
        return loaded_during_relay, router.factory.loads

    loaded_during_relay, loads = asyncio.run(scenario())
    assert loaded_during_relay
    assert loads[:2] == ["alpha", "beta"] and loads[2:] in (["alpha"], ["alpha", "beta"])


def test_bad_model_names_get_openai_errors(start) -> None:
    server = start(FakeModels())
    resp = chat(server.url, "gamma")
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'alpha'" in error["message"] and "'beta'" in error["message"]
    resp = chat(server.url, None)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "model_required"
    for path in ("/models/load", "/models/unload"):
        resp = httpx.post(f"{server.url}{path}", json={"model": "gamma"})
        assert resp.status_code == 404, resp.text
    assert httpx.get(f"{server.url}/v1/models/gamma").status_code == 404
    # GET endpoints name their model in the query (llama.cpp's router)
    assert httpx.get(f"{server.url}/slots").status_code == 400
    assert httpx.get(f"{server.url}/slots", params={"model": "gamma"}).status_code == 404
    assert statuses(server.url) == {"alpha": "unloaded", "beta": "unloaded"}


def test_load_and_unload_endpoints(start) -> None:
    models = FakeModels(token_delay=0.05)
    server = start(models)
    resp = httpx.post(f"{server.url}/models/load", json={"model": "alpha"})
    assert resp.status_code == 200 and resp.json() == {"success": True}
    wait_status(server.url, "alpha", "loaded")
    resp = httpx.post(f"{server.url}/models/load", json={"model": "alpha"})
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "model_already_loaded"
    resp = httpx.post(f"{server.url}/models/unload", json={"model": "beta"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "model_not_loaded"
    # a streamed answer keeps the model busy: it cannot be unloaded under it
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json={"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        timeout=30,
    ) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        resp = httpx.post(f"{server.url}/models/unload", json={"model": "alpha"})
        assert resp.status_code == 409 and resp.json()["error"]["code"] == "model_busy"
        assert "data: [DONE]" in list(lines)
    assert httpx.get(f"{server.url}/slots", params={"model": "alpha"}).json() == []
    resp = httpx.post(f"{server.url}/models/unload", json={"model": "alpha"})
    assert resp.status_code == 200, resp.text
    assert statuses(server.url)["alpha"] == "unloaded"
    gc.collect()
    assert models.engines[0]() is None
    assert chat(server.url, "alpha").status_code == 200  # loads again on use
    assert models.loads == ["alpha", "alpha"]


def test_a_client_gone_mid_stream_leaves_its_model_idle(start) -> None:
    server = start(FakeModels(token_delay=0.05))
    body = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as stream:
        next(line for line in stream.iter_lines() if line.startswith("data:"))
    deadline = time.monotonic() + 10
    while (resp := httpx.post(f"{server.url}/models/unload", json={"model": "alpha"})).is_error:
        assert resp.status_code == 409 and time.monotonic() < deadline, resp.text
        time.sleep(0.05)
    assert statuses(server.url)["alpha"] == "unloaded"


def test_without_autoload_only_an_explicit_load_loads(start) -> None:
    server = start(FakeModels(), models_autoload=False)
    resp = chat(server.url, "alpha")
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "model_not_loaded"
    assert httpx.post(f"{server.url}/models/load", json={"model": "alpha"}).status_code == 200
    wait_status(server.url, "alpha", "loaded")
    assert chat(server.url, "alpha").status_code == 200


def test_without_autoload_a_failed_model_says_why_not_just_not_loaded(start) -> None:
    models = FakeModels(broken=("alpha",))
    server = start(models, models_autoload=False)
    assert httpx.post(f"{server.url}/models/load", json={"model": "alpha"}).status_code == 200
    deadline = time.monotonic() + 10
    while model_metrics(server.url)[("cellserve_model_load_failures_total", "alpha")] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    for params in ({}, {"autoload": "false"}):
        body = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}]}
        resp = httpx.post(f"{server.url}/v1/chat/completions", params=params, json=body)
        assert resp.status_code == 503, resp.text
        error = resp.json()["error"]
        assert error["code"] == "model_load_failed" and "not a GGUF file" in error["message"]
    # a model that never failed is still only "not loaded"
    resp = chat(server.url, "beta")
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "model_not_loaded"


def test_a_model_that_fails_to_load_says_why_and_breaks_nothing(start) -> None:
    models = FakeModels(broken=("alpha",))
    server = start(models, models_max=1)
    resp = chat(server.url, "alpha")
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert error["code"] == "model_load_failed" and "not a GGUF file" in error["message"]
    listed = {m["id"]: m["status"] for m in httpx.get(f"{server.url}/models").json()["data"]}
    assert listed["alpha"]["value"] == "unloaded" and listed["alpha"]["failed"] is True
    assert listed["beta"]["value"] == "unloaded" and listed["beta"]["failed"] is False
    assert "error" not in listed["beta"]
    assert "not a GGUF file" in listed["alpha"]["error"]
    assert chat(server.url, "beta").status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert model_metrics(server.url)[("cellserve_model_load_failures_total", "alpha")] == 1
    # an explicit load tries again (and fails again)
    assert httpx.post(f"{server.url}/models/load", json={"model": "alpha"}).status_code == 200
    deadline = time.monotonic() + 10
    while model_metrics(server.url)[("cellserve_model_load_failures_total", "alpha")] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # the retry made room first (--models-max 1): beta was idle, so it went, and once the
    # load failed beta loaded again by itself
    wait_status(server.url, "beta", "loaded")
    assert statuses(server.url) == {"alpha": "unloaded", "beta": "loaded"}
    assert models.loads == ["beta", "beta"]
    assert chat(server.url, "beta").status_code == 200
