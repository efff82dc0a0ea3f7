"""GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET /slots, GET /metrics."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool

from server.auth import check_api_key
from server.backend import Backend
from server.deps import BackendDep, EngineDep, MetricsDep, check_model
from server.errors import APIError
from server.prompts import check_token_ids, encode_text, tokenize_chat
from server.schemas import DetokenizeRequest, TokenizeRequest
from server.schemas_out import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    TokenPiece,
)
from server.unsupported import reject_non_text_messages

router = APIRouter(dependencies=[Depends(check_api_key)])
open_router = APIRouter()


@router.get("/v1/models")
async def list_models(backend: BackendDep, request: Request) -> ModelList:
    created, n_ctx = request.app.state.started_at, backend.n_ctx_seq
    cards = [ModelCard(id=backend.model_name, created=created, max_model_len=n_ctx)]
    for a in [] if backend.loras is None else backend.loras.adapters:
        cards.append(
            ModelCard(
                id=a.name,
                created=created,
                max_model_len=n_ctx,
                root=a.path,
                parent=backend.model_name,
            )
        )
    return ModelList(data=cards)


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, backend: BackendDep, request: Request) -> ModelCard:
    check_model(model_id, backend)
    adapter = None if backend.loras is None else backend.loras.find(model_id)
    cards = (await list_models(backend, request)).data
    return next((c for c in cards if adapter is not None and c.id == adapter.name), cards[0])


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, backend: BackendDep) -> TokenizeResponse:
    check_model(body.model, backend)
    prompt = body.prompt if body.prompt is not None else body.content
    if (prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
    if body.messages is not None:
        if not body.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        # the same ids /v1/chat/completions would submit, so usage.prompt_tokens == count
        reject_non_text_messages(body.messages)
        kwargs = dict(body.chat_template_kwargs or {})
        if body.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
        tokens, _ = await run_in_threadpool(
            tokenize_chat, backend, body.messages, body.add_generation_prompt, kwargs
        )
    else:
        add_special = next(
            (v for v in (body.add_special_tokens, body.add_special) if v is not None), True
        )
        tokens = await run_in_threadpool(encode_text, backend.tokenizer, prompt or "", add_special)
    out = [_piece(backend, t) for t in tokens] if body.with_pieces else tokens
    return TokenizeResponse(tokens=out, count=len(tokens), max_model_len=backend.n_ctx_seq)


def _piece(backend: Backend, token_id: int) -> TokenPiece:
    raw = backend.tokenizer.token_bytes(token_id)
    try:
        return TokenPiece(id=token_id, piece=raw.decode("utf-8"))
    except UnicodeDecodeError:
        return TokenPiece(id=token_id, piece=list(raw))


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, backend: BackendDep) -> DetokenizeResponse:
    check_model(body.model, backend)
    check_token_ids(backend, body.tokens, "tokens")
    return DetokenizeResponse(prompt=backend.tokenizer.decode(body.tokens))


@router.get("/slots")
async def slots(engine: EngineDep) -> list[dict[str, Any]]:
    return [asdict(s) for s in engine.slots()]


@open_router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = request.app.state
    if state.draining or state.leaving:
        return JSONResponse({"status": "draining"}, 503)
    if state.router is not None:  # several models, each loaded on demand (routes_models.py)
        return JSONResponse({"status": "ok"})
    if state.backend is None:
        status = "error" if state.load_error else "loading"
        return JSONResponse({"status": status}, 503)
    stats = state.backend.engine.stats()
    if not stats.alive:
        return JSONResponse({"status": "engine_dead"}, 503)
    return JSONResponse({"status": "ok"})


async def metrics(metrics: MetricsDep) -> Response:
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)


def metrics_router(protect: bool) -> APIRouter:
    r = APIRouter(dependencies=[Depends(check_api_key)] if protect else [])
    # Prometheus text, documented as such in the OpenAPI schema
    r.add_api_route("/metrics", metrics, methods=["GET"], response_class=PlainTextResponse)
    return r
