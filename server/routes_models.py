"""Several models in one server (server/model_router.py): the model list with each model's
status, llama.cpp's POST /models/load and /models/unload, and the dependency that hands each
request the Backend its `model` names.

Mounted only in router mode, before server/routes_misc.py, so that GET /v1/models lists every
model (loaded or not) instead of the one Backend of a single-model server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict

from server.auth import check_api_key
from server.backend import Backend
from server.deps import ROUTER_NO_MODEL
from server.errors import APIError
from server.model_router import ModelEntry, ModelRouter
from server.settings import Settings

router = APIRouter(dependencies=[Depends(check_api_key)], tags=["models"])


def get_router(request: Request) -> ModelRouter:
    return request.app.state.router


async def requested_model(request: Request) -> str | None:
    """The `model` of a request: `?model=` (llama.cpp's router, for GET), else the JSON body's
    (starlette caches the body, so the route still reads it)."""
    name = request.query_params.get("model")
    if name is None and request.method == "POST":
        try:
            body = json.loads(await request.body() or b"null")
        except ValueError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            name = body["model"]
    return None if name in (None, "", ROUTER_NO_MODEL) else name


def requested_autoload(request: Request) -> bool | None:
    """llama.cpp's per-request `?autoload=true|false` (also 1|0); None: --[no-]models-autoload."""
    value = request.query_params.get("autoload")
    if value is None or value == "":
        return None
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise APIError(400, f"autoload must be true or false, not {value!r}", param="autoload")


async def routed_backend(request: Request) -> AsyncIterator[Backend]:
    """Replaces server.deps.get_backend in router mode: the named model's Backend, loaded
    first if it is not (this request waits; `?autoload=` decides whether it may load it),
    held busy until the response is sent."""
    state = request.app.state
    if state.draining:
        raise APIError(503, "the server is shutting down", code="draining")
    models: ModelRouter = state.router
    autoload = requested_autoload(request)
    entry = models.find(await requested_model(request))
    backend = await models.acquire(entry, autoload)
    try:
        yield backend
    finally:
        models.release(entry)


# not in a model's `args`: the server's own address, key and router flags (llama.cpp's router
# leaves its API key, models dir and max out of its children's command lines too)
_SERVER_WIDE = frozenset(
    ("host", "port", "api_key", "model", "served_model_name")
    + ("models", "models_dir", "models_max", "models_autoload")
)


def command_line(settings: Settings) -> list[str]:
    """llama.cpp's status `args` (its child process's command line): the `cellserve serve`
    command that serves this model alone as the router serves it, from `settings`
    (ModelRouter.model_settings): the model, its name, then each flag or CELLSERVE_* variable
    the server was given but the server-wide ones."""
    args = ["cellserve", "serve", "--model", str(settings.model)]
    args += ["--served-model-name", str(settings.served_model_name)]
    for name in sorted(settings.model_fields_set - _SERVER_WIDE):
        value, flag = getattr(settings, name), "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None and not isinstance(value, list):  # lists: --lora, not routed
            args += [flag, str(value)]
    return args


def model_card(entry: ModelEntry, created: int, n_ctx: int, args: list[str]) -> dict[str, Any]:
    """OpenAI's model object plus llama.cpp's router `path` and `status` (value, args, failed)
    and the error; vLLM's `root` (the path too) and `max_model_len`."""
    status: dict[str, Any] = {"value": entry.status, "args": args}
    status["failed"] = entry.error is not None
    if entry.error is not None:
        status["error"] = entry.error
    backend = entry.backend
    return {
        "id": entry.name,
        "object": "model",
        "created": created,
        "owned_by": "cellserve",
        "path": entry.source.path,
        "root": entry.source.path,
        "max_model_len": backend.n_ctx_seq if backend is not None else n_ctx,
        "status": status,
    }


@router.get("/v1/models")
@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    models = get_router(request)
    state = request.app.state
    n_ctx = min(state.settings.ctx_per_seq, state.settings.n_cells)
    cards = [
        model_card(e, state.started_at, n_ctx, command_line(models.model_settings(e)))
        for e in models.entries.values()
    ]
    return {"object": "list", "data": cards}


@router.get("/v1/models/{model_id:path}")
@router.get("/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    models = get_router(request)
    entry = models.find(model_id)
    settings, created = request.app.state.settings, request.app.state.started_at
    n_ctx = min(settings.ctx_per_seq, settings.n_cells)
    return model_card(entry, created, n_ctx, command_line(models.model_settings(entry)))


class ModelName(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str


@router.post("/models/load")
async def load_model(body: ModelName, request: Request) -> dict[str, Any]:
    """llama.cpp's: starts the load and answers at once; GET /models shows when it is loaded
    (or failed). A model that failed to load before is tried again."""
    models = get_router(request)
    entry = models.find(body.model)
    if entry.status == "unloading" and entry.task is not None:
        await asyncio.shield(entry.task)
    if entry.status != "unloaded":
        raise APIError(
            400,
            f"the model {entry.name!r} is already {entry.status}",
            param="model",
            code="model_already_loaded",
        )
    models.start_load(entry)
    return {"success": True}


@router.post("/models/unload")
async def unload_model(body: ModelName, request: Request) -> dict[str, Any]:
    """Frees the model's engine, cache and weights before answering; 409 while requests use it."""
    models = get_router(request)
    entry = models.find(body.model)
    models.check_unload(entry)
    await models.unload(entry)
    return {"success": True}
