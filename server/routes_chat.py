"""POST /v1/chat/completions."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request

from server.auth import check_api_key
from server.chat_reply import ReplyOptions, ReplyStream, whole_reply
from server.chat_run import start_chat
from server.deps import (
    BackendDep,
    MetricsDep,
    SettingsDep,
    collect,
    sse_response,
)
from server.generation import Generation
from server.logprobs import chat_logprobs
from server.lora import reply_model
from server.schemas import ChatCompletionRequest
from server.schemas_out import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Usage,
)

router = APIRouter(dependencies=[Depends(check_api_key)], tags=["openai"])


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    backend: BackendDep,
    settings: SettingsDep,
    metrics: MetricsDep,
) -> Any:
    run = await start_chat(body, f"chatcmpl-{uuid.uuid4().hex}", backend, settings, metrics)
    gen, req_id, created = run.gen, run.req_id, run.created
    if body.stream:
        return sse_response(gen, lambda g: _chunks(g, req_id, created, body, run.opts))

    results = await collect(gen, request, [""] * body.n)
    choices = []
    for r in results:
        message, reason = whole_reply(r.text, r.finish_reason or "stop", run.opts)
        as_ids = body.return_tokens_as_token_ids
        logprobs = chat_logprobs(backend.tokenizer, r.logprobs, as_ids) if body.logprobs else None
        choices.append(
            ChatChoice(index=r.index, message=message, logprobs=logprobs, finish_reason=reason)
        )
    return ChatCompletion(
        id=req_id,
        created=created,
        model=reply_model(backend, body.model),
        choices=choices,
        usage=Usage.of(*gen.usage()),
    )


async def _chunks(
    gen: Generation,
    req_id: str,
    created: int,
    body: ChatCompletionRequest,
    opts: ReplyOptions,
) -> AsyncIterator[ChatCompletionChunk]:
    head: dict[str, Any] = {
        "id": req_id,
        "created": created,
        "model": reply_model(gen.backend, body.model),
    }
    if body.include_usage:
        head["usage"] = None
    tok = gen.backend.tokenizer

    def chunk(index: int, delta: ChatDelta, logprobs: Any = None, reason: str | None = None):
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason)
        return ChatCompletionChunk(**head, choices=[choice])

    replies = [ReplyStream(opts) for _ in range(body.n)]
    for i in range(body.n):
        yield chunk(i, ChatDelta(role="assistant", content=""))
    async for d in gen.deltas():
        reply = replies[d.index]
        as_ids = body.return_tokens_as_token_ids
        lp = chat_logprobs(tok, d.logprobs, as_ids) if body.logprobs and d.logprobs else None
        pieces = reply.feed(d.text) if d.text else []
        if lp is not None and not pieces:
            pieces = [ChatDelta(content="")]
        for k, piece in enumerate(pieces):
            yield chunk(d.index, piece, lp if k == 0 else None)
        if d.finish_reason is not None:
            last, reason = reply.finish(d.finish_reason)
            for piece in last:
                yield chunk(d.index, piece)
            yield chunk(d.index, ChatDelta(), None, reason)
    if body.include_usage:
        yield ChatCompletionChunk(**{**head, "usage": Usage.of(*gen.usage())}, choices=[])
