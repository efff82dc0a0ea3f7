"""FastAPI dependencies and helpers shared by the routers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Request
from pydantic import BaseModel
from sse_starlette import EventSourceResponse

from server.backend import Backend
from server.engine_client import EngineClient
from server.errors import APIError, error_body
from server.generation import ChoiceDelta, Generation, GenerationError
from server.metrics import Metrics
from server.settings import Settings

log = logging.getLogger("cellserve.server")


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


def get_backend(request: Request) -> Backend:
    state = request.app.state
    if state.draining:
        raise APIError(503, "the server is shutting down", code="draining")
    if state.backend is None:
        msg = "the model failed to load" if state.load_error else "the model is still loading"
        raise APIError(503, msg, code="not_ready")
    return state.backend


def get_engine(backend: Annotated[Backend, Depends(get_backend)]) -> EngineClient:
    return backend.engine


SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
BackendDep = Annotated[Backend, Depends(get_backend)]
EngineDep = Annotated[EngineClient, Depends(get_engine)]


# sglang-router fills a request that names no model with this id before forwarding it
# (its UNKNOWN_MODEL_ID); it means "no model given", not a model called "unknown".
ROUTER_NO_MODEL = "unknown"


def check_model(name: str | None, backend: Backend) -> None:
    """404 unless `name` is the served model, one of its LoRA adapters (server/lora.py) or
    None."""
    if backend.loras is not None and backend.loras.find(name) is not None:
        return
    if name is not None and name not in (backend.model_name, ROUTER_NO_MODEL):
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {backend.model_name!r}",
            param="model",
            code="model_not_found",
        )


def check_generative(backend: Backend) -> None:
    """An embedding model generates nothing: the generation endpoints answer 400 (vLLM's)."""
    if backend.task == "embed":
        raise APIError(
            400,
            f"the model {backend.model_name!r} is an embedding model: it serves /v1/embeddings "
            "only, not text generation (chat, completions, responses, messages, infill)",
            param="model",
            code="model_not_supported",
        )


def log_request(settings: Settings, req_id: str, prompt: Any, num_tokens: int, **info: Any) -> None:
    details = " ".join(f"{k}={v}" for k, v in info.items())
    log.info("request %s: %d prompt tokens %s", req_id, num_tokens, details)
    if settings.log_prompts:
        log.info("request %s prompt: %r", req_id, prompt)


async def _abort_on_disconnect(request: Request, gen: Generation) -> None:
    while not gen.finished:
        if await request.is_disconnected():
            log.info("client gone: aborting %s", gen.requests[0].req_id)
            gen.cancel()
            return
        await asyncio.sleep(0.25)


async def collect(
    gen: Generation,
    request: Request,
    prefixes: list[str],
    deltas: AsyncIterator[ChoiceDelta] | None = None,
) -> list[ChoiceDelta]:
    """Run to the end (non-streaming) and fold the deltas (`gen.deltas()`, or `deltas` made
    from them) into one ChoiceDelta per choice, its text starting with `prefixes[i]`; the
    request is aborted if the client goes away."""
    watcher = asyncio.create_task(_abort_on_disconnect(request, gen))
    choices = [ChoiceDelta(i, prefix, []) for i, prefix in enumerate(prefixes)]
    try:
        async for delta in deltas or gen.deltas():
            choice = choices[delta.index]
            choice.text += delta.text
            choice.logprobs.extend(delta.logprobs)
            choice.finish_reason = delta.finish_reason or choice.finish_reason
            choice.stop_string = delta.stop_string or choice.stop_string
    except GenerationError as exc:
        raise APIError(exc.status, str(exc), code=exc.code) from exc
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    return choices


# Characters JSON leaves raw (ensure_ascii=False) that Python's str.splitlines, and with it
# httpx's aiter_lines, takes for line ends: a token that decodes to one of them split an SSE
# `data:` line in two for such a client (a cut-off JSON string). Escaped, they stay the same text.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def dump_json(model: BaseModel) -> str:
    """An SSE event's data: compact JSON, UTF-8 text as is but for the characters above."""
    text = json.dumps(model.model_dump(mode="json"), ensure_ascii=False, separators=(",", ":"))
    return text.translate(_LINE_BREAKS)


def on_client_gone(gen: Generation) -> Callable[[object], Awaitable[None]]:
    """The SSE response's close handler: aborts what is unfinished (and says so in the log); a
    client that closes after the last event is not an abort."""

    async def client_gone(_: object) -> None:
        if not gen.finished:
            log.info("client gone: aborting %s", gen.requests[0].req_id)
            gen.cancel()

    return client_gone


def sse_response(
    gen: Generation,
    chunks: Callable[[Generation], AsyncIterator[BaseModel]],
    done: bool = True,
) -> EventSourceResponse:
    """SSE stream of OpenAI chunks, then `data: [DONE]` (not with `done` False: llama.cpp's
    own routes end without it); errors become an error chunk."""

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks(gen):
                yield dump_json(chunk)
        except GenerationError as exc:
            yield json.dumps(error_body(exc.status, str(exc), code=exc.code))
        finally:
            gen.cancel()
        if done:
            yield "[DONE]"

    return EventSourceResponse(events(), ping=15, client_close_handler_callable=on_client_gone(gen))
