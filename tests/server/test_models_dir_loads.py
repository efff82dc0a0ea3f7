"""Loads in a multi-model server (server/model_router.py): llama.cpp's per-request
`?autoload=true|false`."""

from __future__ import annotations

import httpx
import pytest

from tests.server.test_models_dir import (
    FakeModels,
    chat,
    make_models_dir,
    statuses,
)


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
