"""POST /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from server.auth import check_api_key
from server.deps import (
    BackendDep,
    MetricsDep,
    SettingsDep,
    check_model,
    collect,
    log_request,
    sse_response,
)
from server.errors import APIError
from server.generation import Generation
from server.logprobs import chat_logprobs
from server.prompts import make_request, tokenize_chat
from server.schemas import ChatCompletionRequest
from server.schemas_out import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Usage,
)
from server.unsupported import CHAT_RULES, reject_non_text_messages, reject_unsupported

router = APIRouter(dependencies=[Depends(check_api_key)], tags=["openai"])


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    backend: BackendDep,
    settings: SettingsDep,
    metrics: MetricsDep,
) -> Any:
    check_model(body.model, backend)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    reject_unsupported(body, CHAT_RULES)
    reject_non_text_messages(body.messages)
    # NOTE: off the event loop: a long prompt takes a while to render and tokenize
    prompt_ids, n_keep = await run_in_threadpool(
        tokenize_chat, backend, body.messages, body.add_generation_prompt
    )
    max_tokens = body.max_completion_tokens or body.max_tokens
    room = backend.n_ctx_seq - len(prompt_ids)
    req_id = f"chatcmpl-{uuid.uuid4().hex}"
    engine_request = make_request(
        req_id,
        prompt_ids,
        body,
        backend=backend,
        settings=settings,
        max_tokens=max_tokens,
        default_max_tokens=max(1, min(settings.max_tokens_limit, room)),
        n_keep=n_keep,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        prompt_param="messages",
    )
    log_request(settings, req_id, body.messages, len(prompt_ids), n=body.n, stream=body.stream)
    gen = Generation(
        backend,
        metrics,
        [engine_request],
        body.stop_list,
        settings.request_timeout,
        body.logprobs,
        max_buffered=settings.stream_buffer,
        prompt_param="messages",
    )
    gen.submit()
    created = int(time.time())
    if body.stream:
        return sse_response(gen, lambda g: _chunks(g, req_id, created, body))

    results = await collect(gen, request, [""] * body.n)
    choices = [
        ChatChoice(
            index=r.index,
            message=AssistantMessage(content=r.text),
            logprobs=chat_logprobs(backend.tokenizer, r.logprobs) if body.logprobs else None,
            finish_reason=r.finish_reason,
        )
        for r in results
    ]
    return ChatCompletion(
        id=req_id,
        created=created,
        model=backend.model_name,
        choices=choices,
        usage=Usage.of(*gen.usage()),
    )


async def _chunks(
    gen: Generation, req_id: str, created: int, body: ChatCompletionRequest
) -> AsyncIterator[ChatCompletionChunk]:
    head: dict[str, Any] = {"id": req_id, "created": created, "model": gen.backend.model_name}
    if body.include_usage:
        head["usage"] = None
    tok = gen.backend.tokenizer

    def chunk(index: int, delta: ChatDelta, logprobs: Any = None, reason: str | None = None):
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason)
        return ChatCompletionChunk(**head, choices=[choice])

    for i in range(body.n):
        yield chunk(i, ChatDelta(role="assistant", content=""))
    async for d in gen.deltas():
        if d.text or d.logprobs:
            lp = chat_logprobs(tok, d.logprobs) if body.logprobs else None
            yield chunk(d.index, ChatDelta(content=d.text), lp)
        if d.finish_reason is not None:
            yield chunk(d.index, ChatDelta(), None, d.finish_reason)
    if body.include_usage:
        yield ChatCompletionChunk(**{**head, "usage": Usage.of(*gen.usage())}, choices=[])
