"""create_app(settings): the FastAPI app and its lifespan (load the model, run the engine)."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server import (
    routes_anthropic,
    routes_chat,
    routes_completions,
    routes_discovery,
    routes_embeddings,
    routes_infill,
    routes_llama,
    routes_lora,
    routes_misc,
    routes_models,
    routes_render,
    routes_responses,
    routes_slots,
)
from server.auth import check_api_key
from server.backend import Backend, BackendFactory
from server.cache_config import cache_config_labels
from server.deps import get_backend
from server.errors import BodyTooLargeError, error_response, install_error_handlers
from server.kv_events import start_kv_events
from server.metrics import Metrics
from server.metrics_models import ModelsCollector
from server.model_router import ModelRouter
from server.models_dir import model_sources
from server.process_memory import MemoryParts, memory_breakdown
from server.settings import Settings

log = logging.getLogger("cellserve.server")
STATIC_DIR = Path(__file__).parent / "static"


class RequestGuard:
    """ASGI middleware: 413 for bodies over the limit (Content-Length AND the bytes actually
    received), and a count of HTTP requests in flight for the graceful drain."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, state: Any) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                too_large = error_response(413, BodyTooLargeError(limit).detail, path=scope["path"])
                await too_large(scope, receive, send)
                return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLargeError(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        self.state.num_in_flight += 1
        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLargeError as exc:
            if started:
                raise
            await error_response(413, exc.detail, path=scope["path"])(scope, receive, send)
        finally:
            self.state.num_in_flight -= 1


def build_default_backend(settings: Settings, on_step) -> Backend:
    from server.model_backend import load_backend  # torch + the model load lazily

    return load_backend(settings, on_step)


async def _load(app: FastAPI, factory: BackendFactory) -> None:
    settings: Settings = app.state.settings
    metrics: Metrics = app.state.metrics
    try:
        backend = await asyncio.to_thread(factory, settings, metrics.on_step)
        app.state.kv_events = start_kv_events(settings, backend)
        backend.engine.start()
    except Exception as exc:
        app.state.load_error = f"{type(exc).__name__}: {exc}"
        log.error("cannot serve the model: %s", app.state.load_error)
        if app.state.on_load_error is not None:  # `cellserve serve`: exit 1 now
            app.state.on_load_error(exc)
        return
    metrics.bind_engine(backend.engine.stats)
    metrics.set_runtime(backend.runtime)
    metrics.bind_expert_load(backend.expert_load)
    metrics.bind_tier(getattr(backend.engine, "tier_stats", None))
    if backend.loras is not None:
        metrics.set_lora_names(backend.loras.names())
    parts = MemoryParts(
        backend.weights_mapped_bytes,
        backend.weights_owned_bytes,
        backend.cache_bytes,
        backend.state_bytes,
        backend.cache_ranges,
    )
    metrics.set_memory(parts)
    if backend.cache_bytes_per_cell:
        metrics.set_cell_bytes(
            backend.cache_bytes_per_cell,
            backend.runtime.get("cache_type_k", ""),
            backend.runtime.get("cache_type_v", ""),
        )
    metrics.set_cache_config(cache_config_labels(backend, settings))
    app.state.backend = backend
    mib = backend.cache_bytes / 2**20
    log.info(
        "memory (MiB): %s",
        ", ".join(f"{k} {v / 2**20:.0f}" for k, v in memory_breakdown(parts).items()),
    )
    print(
        f"cellserve: serving {backend.model_name} | KV cache {backend.n_cells} cells "
        f"({mib:.1f} MiB) | context {backend.n_ctx_seq} per sequence | {settings.url}"
        + "".join(
            f" | {k} {backend.runtime[k]}"
            for k in ("isa", "dtype", "quant")
            if backend.runtime.get(k)
        ),
        flush=True,
    )


async def drain(app: FastAPI) -> None:
    """Stop admission, let running requests finish (bounded by drain_timeout), stop the engine.
    Idempotent: SIGTERM calls it first, the lifespan again at exit."""
    state = app.state
    state.draining = True
    if state.drain_task is None:
        state.drain_task = asyncio.ensure_future(_drain(app))
    await asyncio.shield(state.drain_task)


async def _drain(app: FastAPI) -> None:
    state = app.state
    if state.load_task is not None and not state.load_task.done():
        state.load_task.cancel()
    if state.backend is not None:
        await asyncio.to_thread(state.backend.engine.shutdown, state.settings.drain_timeout)
    if state.router is not None:
        await state.router.close()
    if state.kv_events is not None:
        state.kv_events.close()
        state.kv_events = None
    # the engine has finished every request; let their responses reach the clients
    deadline = time.monotonic() + 5.0
    while state.num_in_flight > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def _start_router(app: FastAPI, factory: BackendFactory) -> None:
    """Several models: nothing loads before a request (or POST /models/load) names one."""
    settings: Settings = app.state.settings
    metrics: Metrics = app.state.metrics
    sources = model_sources(settings)
    app.state.router = ModelRouter(settings, sources, factory, metrics.on_step)
    metrics.registry.register(ModelsCollector(app.state.router))
    print(
        f"cellserve: serving {len(sources)} models, at most {settings.models_max} loaded "
        f"(KV cache {settings.n_cells} cells each) | {settings.url} | "
        + ", ".join(s.name for s in sources),
        flush=True,
    )


def create_app(settings: Settings, backend_factory: BackendFactory | None = None) -> FastAPI:
    factory = backend_factory or build_default_backend

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.router_mode:
            _start_router(app, factory)
        else:
            app.state.load_task = asyncio.create_task(_load(app, factory))
        try:
            yield
        finally:
            await drain(app)

    app = FastAPI(title="cellserve", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.backend = None
    app.state.load_error = None
    app.state.on_load_error = None  # called with the exception when the model cannot load
    app.state.load_task = None
    app.state.drain_task = None
    app.state.kv_events = None  # server.kv_events.KVEventPublisher when enabled
    app.state.router = None  # server.model_router.ModelRouter with several models
    app.state.draining = False  # admission stopped (SIGTERM, after --drain-grace)
    app.state.leaving = False  # SIGTERM received: /health answers 503 from now on
    app.state.num_in_flight = 0
    app.state.started_at = int(time.time())
    install_error_handlers(app)
    app.add_middleware(RequestGuard, max_body_bytes=settings.max_body_bytes, state=app.state)
    if settings.cors_origins:
        # NOTE: added last, so outermost: preflights are answered before auth and the body
        # limit, and error responses carry the CORS headers too. No credentials (cookies):
        # the API key travels in the Authorization header, which preflight allows.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            max_age=600,
        )

    if settings.router_mode:
        # NOTE: before routes_misc: its GET /v1/models lists one Backend's model
        app.include_router(routes_models.router)
        app.dependency_overrides[get_backend] = routes_models.routed_backend
    app.include_router(routes_chat.router)
    app.include_router(routes_completions.router)
    app.include_router(routes_embeddings.router)
    app.include_router(routes_responses.router)
    app.include_router(routes_anthropic.router)
    app.include_router(routes_infill.router)
    app.include_router(routes_llama.router)
    app.include_router(routes_slots.router)
    app.include_router(routes_lora.router)
    app.include_router(routes_misc.router)
    app.include_router(routes_discovery.router)
    app.include_router(routes_render.router)
    app.include_router(routes_misc.open_router)
    app.include_router(routes_misc.metrics_router(settings.protect_metrics))
    if importlib.util.find_spec("server.cache_map") is not None:
        cache_map = importlib.import_module("server.cache_map")
        app.include_router(cache_map.router, dependencies=[Depends(check_api_key)])
    if (STATIC_DIR / "index.html").is_file():
        app.mount("/", _StaticPages(directory=STATIC_DIR, html=True), name="static")
    return app


class _StaticPages(StaticFiles):
    """The web page at `/`; any other method on an unknown path is a 404, not a 405."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD"):
            raise StarletteHTTPException(404, "route not found")
        await super().__call__(scope, receive, send)
