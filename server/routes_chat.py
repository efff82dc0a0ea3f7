"""POST /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request

from model.tool_prompt import HERMES
from server.auth import check_api_key
from server.backend import Backend
from server.chat_reply import ReplyOptions, ReplyStream, whole_reply
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
from server.reasoning import opens_thinking
from server.schemas import ChatCompletionRequest
from server.schemas_out import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Usage,
)
from server.structured import (
    body_grammar_spec,
    check_tool_choice,
    compile_grammar,
    tool_grammar_spec,
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
    check_model(body.model, backend)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    check_tool_choice(body.tools, body.tool_choice)
    prompt_ids, n_keep = tokenize_chat(
        backend, body.messages, body.add_generation_prompt, template_kwargs(body)
    )
    opts = reply_options(backend, body, prompt_ids)
    spec = body_grammar_spec(body)
    if opts.tool_format is not None and body.tools:
        spec = (
            tool_grammar_spec(
                body.tools, body.tool_choice, body.parallel_tool_calls, opts.tool_format
            )
            or spec
        )
    grammar = await compile_grammar(backend, spec) if spec is not None else None
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
        grammar=grammar,
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
        return sse_response(gen, lambda g: _chunks(g, req_id, created, body, opts))

    results = await collect(gen, request, [""] * body.n)
    choices = []
    for r in results:
        message, reason = whole_reply(r.text, r.finish_reason or "stop", opts)
        logprobs = chat_logprobs(backend.tokenizer, r.logprobs) if body.logprobs else None
        choices.append(
            ChatChoice(index=r.index, message=message, logprobs=logprobs, finish_reason=reason)
        )
    return ChatCompletion(
        id=req_id,
        created=created,
        model=backend.model_name,
        choices=choices,
        usage=Usage.of(*gen.usage()),
    )


def template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    """What reaches the chat template beyond the messages: chat_template_kwargs, the tools
    (not with tool_choice "none": the model is not shown them), reasoning_effort."""
    kwargs: dict[str, Any] = dict(body.chat_template_kwargs or {})
    if body.tools and body.tool_choice != "none":
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    return kwargs


def reply_options(
    backend: Backend, body: ChatCompletionRequest, prompt_ids: list[int]
) -> ReplyOptions:
    uses_tools = bool(body.tools) and body.tool_choice != "none"
    fmt = getattr(backend.chat_template, "tool_format", HERMES) if uses_tools else None
    tail = backend.tokenizer.decode(prompt_ids[-8:])
    return ReplyOptions(fmt, body.parallel_tool_calls, opens_thinking(tail))


async def _chunks(
    gen: Generation,
    req_id: str,
    created: int,
    body: ChatCompletionRequest,
    opts: ReplyOptions,
) -> AsyncIterator[ChatCompletionChunk]:
    head: dict[str, Any] = {"id": req_id, "created": created, "model": gen.backend.model_name}
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
        lp = chat_logprobs(tok, d.logprobs) if body.logprobs and d.logprobs else None
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
