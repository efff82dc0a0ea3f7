"""GET /models of a multi-model server as llama.cpp's router reports it: each model's `status`
with `value`, `args` (the command line that serves the model alone) and `failed`."""

from __future__ import annotations

import httpx

from cli.main import build_settings, make_parser
from server.settings import Settings
from tests.server.test_models_dir import FakeModels, chat, make_models_dir

SERVER_FLAGS = {"n_cells": 512, "ctx_per_seq": 256, "log_prompts": True, "prefix_cache": False}


def test_status_args_serve_the_model_alone_as_the_router_does(server_factory, tmp_path) -> None:
    folder = make_models_dir(tmp_path)
    models = FakeModels()
    server = server_factory(
        models, models_dir=str(folder), models_max=1, api_key="sekret", **SERVER_FLAGS
    )
    auth = {"Authorization": "Bearer sekret"}
    cards = {m["id"]: m for m in httpx.get(f"{server.url}/models", headers=auth).json()["data"]}
    status = cards["alpha"]["status"]
    assert status["value"] == "unloaded" and status["failed"] is False
    args = status["args"]
    assert args[:6] == [
        "cellserve",
        "serve",
        "--model",
        str(folder / "alpha.gguf"),
        "--served-model-name",
        "alpha",
    ]
    assert "--api-key" not in args and "sekret" not in args  # the server's key stays out
    assert not any(a.startswith(("--models", "--port", "--host")) for a in args)
    # the command line parses back into the settings the model is loaded with
    parsed = build_settings(make_parser().parse_args(args[1:]))
    assert parsed.model == str(folder / "alpha.gguf") and parsed.served_model_name == "alpha"
    for name, value in SERVER_FLAGS.items():
        assert getattr(parsed, name) == value, name
    assert parsed.models_dir is None and parsed.api_key is None
    # the same args while loaded, and in GET /models/{id}
    assert chat(server.url, "alpha").status_code == 401  # behind the key
    resp = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers=auth,
        json={"model": "alpha", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert resp.status_code == 200
    one = httpx.get(f"{server.url}/models/alpha", headers=auth).json()["status"]
    assert one == {"value": "loaded", "args": args, "failed": False}


def test_args_of_a_server_without_flags_name_only_the_model(tmp_path) -> None:
    from server.model_router import ModelRouter
    from server.models_dir import ModelSource
    from server.routes_models import command_line

    router = ModelRouter(Settings(), [ModelSource("m", "/x/m.gguf")], FakeModels(), print)
    entry = router.entries["m"]
    settings = router.model_settings(entry)
    assert command_line(settings) == [
        "cellserve",
        "serve",
        "--model",
        "/x/m.gguf",
        "--served-model-name",
        "m",
    ]
