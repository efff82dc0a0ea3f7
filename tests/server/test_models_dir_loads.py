"""Loads in a multi-model server (server/model_router.py): llama.cpp's per-request
`?autoload=true|false`, a load that fails on its file (server/model_check.py) costing no
idle model its place under --models-max, and one that fails after making room bringing the
idle model back."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.server.test_models_dir import (
    FakeModels,
    chat,
    make_models_dir,
    model_metrics,
    statuses,
    wait_status,
    write_gguf_header,
)
from tests.tiny_gguf import write_tiny_gguf
from tests.tiny_models import write_tiny_llama


@pytest.fixture
def folder(tmp_path):
    return make_models_dir(tmp_path)


def test_autoload_query_overrides_the_flag_per_request(server_factory, folder) -> None:
    models = FakeModels()
    server = server_factory(models, models_dir=str(folder), models_autoload=False)
    url = f"{server.url}/v1/chat/completions"
    body = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}]}
    resp = httpx.post(url, params={"autoload": "false"}, json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "model_not_loaded"
    assert "?autoload=true" in resp.json()["error"]["message"]
    resp = httpx.post(url, params={"autoload": "true"}, json=body, timeout=30)
    assert resp.status_code == 200 and resp.json()["model"] == "alpha"
    # GET endpoints too (llama.cpp's proxy_get): /props?model=beta&autoload=1 loads beta
    props = httpx.get(f"{server.url}/props", params={"model": "beta", "autoload": "1"})
    assert props.status_code == 200, props.text
    assert statuses(server.url) == {"alpha": "loaded", "beta": "loaded"}
    assert models.loads == ["alpha", "beta"]


def test_autoload_false_refuses_to_load_despite_the_default(server_factory, folder) -> None:
    models = FakeModels()
    server = server_factory(models, models_dir=str(folder))
    resp = httpx.get(f"{server.url}/props", params={"model": "alpha", "autoload": "0"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "model_not_loaded"
    assert models.loads == []
    assert chat(server.url, "alpha").status_code == 200  # the default (autoload) still loads
    # a loaded model serves an autoload=false request
    resp = httpx.get(f"{server.url}/props", params={"model": "alpha", "autoload": "false"})
    assert resp.status_code == 200


def test_a_bad_autoload_value_is_a_400(server_factory, folder) -> None:
    server = server_factory(FakeModels(), models_dir=str(folder))
    resp = httpx.get(f"{server.url}/props", params={"model": "alpha", "autoload": "maybe"})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "autoload" and "'maybe'" in error["message"]


def truncate_a_real_gguf(path) -> None:
    """A tiny model's GGUF cut in its tensor data: the header and tensor infos parse."""
    hf = write_tiny_llama(path.parent.parent / "hf", seed=3)
    data = write_tiny_gguf(path, hf).read_bytes()
    path.write_bytes(data[: len(data) * 3 // 4])


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        (lambda path: path.unlink(), "no such file"),
        (truncate_a_real_gguf, "truncated"),
        (lambda path: path.write_bytes(b"not a gguf at all"), "not a readable GGUF"),
        (lambda path: write_gguf_header(path, arch="gpt2"), "architecture 'gpt2'"),
    ],
    ids=["missing", "truncated", "not-gguf", "unsupported-arch"],
)
def test_a_load_that_fails_on_its_file_keeps_the_idle_model(
    server_factory, folder, spoil, why
) -> None:
    models = FakeModels()
    server = server_factory(models, models_dir=str(folder), models_max=1)
    assert chat(server.url, "beta").status_code == 200
    spoil(folder / "alpha.gguf")
    resp = chat(server.url, "alpha")
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert error["code"] == "model_load_failed" and why in error["message"]
    assert statuses(server.url) == {"alpha": "unloaded", "beta": "loaded"}
    metrics = model_metrics(server.url)
    assert metrics[("cellserve_model_unloads_total", "beta")] == 0
    assert metrics[("cellserve_model_load_failures_total", "alpha")] == 1
    # the explicit retry checks first too
    assert httpx.post(f"{server.url}/models/load", json={"model": "alpha"}).status_code == 200
    deadline = time.monotonic() + 10
    while model_metrics(server.url)[("cellserve_model_load_failures_total", "alpha")] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert statuses(server.url)["beta"] == "loaded"
    assert models.loads == ["beta"]
    # once the file is good, the model loads (in beta's place)
    write_gguf_header(folder / "alpha.gguf")
    assert chat(server.url, "alpha").status_code == 503  # the failure stays until a retry
    assert httpx.post(f"{server.url}/models/load", json={"model": "alpha"}).status_code == 200
    wait_status(server.url, "alpha", "loaded")
    assert statuses(server.url)["beta"] == "unloaded"


def test_a_load_that_fails_after_making_room_brings_the_idle_model_back(
    server_factory, folder
) -> None:
    """No memory for alpha once beta was unloaded for it: beta loads again by itself, also
    without autoload (nothing else would load it), and alpha says why."""
    models = FakeModels(broken=("alpha",))
    models.failure = MemoryError
    server = server_factory(models, models_dir=str(folder), models_max=1, models_autoload=False)
    assert httpx.post(f"{server.url}/models/load", json={"model": "beta"}).status_code == 200
    wait_status(server.url, "beta", "loaded")
    resp = chat(server.url, "alpha", max_tokens=8)
    assert resp.status_code == 400  # not loaded, and no autoload
    url = f"{server.url}/v1/chat/completions"
    body = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}]}
    resp = httpx.post(url, params={"autoload": "true"}, json=body, timeout=30)
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "model_load_failed" and "MemoryError" in error["message"]
    wait_status(server.url, "beta", "loaded")
    assert chat(server.url, "beta").status_code == 200
    metrics = model_metrics(server.url)
    assert metrics[("cellserve_model_unloads_total", "beta")] == 1
    assert metrics[("cellserve_model_loads_total", "beta")] == 2
    assert metrics[("cellserve_model_load_failures_total", "alpha")] == 1
    assert models.loads == ["beta", "beta"]
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize(
    ("config", "why"),
    [
        (None, "no config.json"),
        ("{not json", "not valid JSON"),
        ('["a list"]', "model_type None"),
        ('{"model_type": "gpt2"}', "model_type 'gpt2'"),
    ],
    ids=["no-config", "not-json", "not-an-object", "unsupported"],
)
def test_a_folder_is_checked_by_its_config(tmp_path, config, why) -> None:
    from model.errors import ModelLoadError
    from server.model_check import check_model_path

    folder = tmp_path / "hf"
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(config)
    with pytest.raises(ModelLoadError, match=why.replace("(", r"\(")):
        check_model_path(str(folder))
    (folder / "config.json").write_text('{"model_type": "qwen2"}')
    check_model_path(str(folder))  # what the loader reads: no error here
