"""Start a chat generation from a validated ChatCompletionRequest: the part that
/v1/chat/completions and /v1/responses share (checks, template, tokenize, submit)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from model.load.tool_prompt import HERMES
from scheduler.request import Request as EngineRequest
from server.backend import Backend
from server.chat_reply import ReplyOptions
from server.deps import check_generative, check_model, log_request
from server.errors import APIError
from server.generation import Generation
from server.metrics import Metrics
from server.prompts import make_request, tokenize_chat
from server.reasoning import opens_thinking
from server.schemas import ChatCompletionRequest
from server.settings import Settings
from server.structured import (
    body_grammar_spec,
    check_tool_choice,
    compile_grammar,
    tool_grammar_spec,
)
from server.unsupported import CHAT_RULES, reject_non_text_messages, reject_unsupported


@dataclass(slots=True)
class ChatRun:
    req_id: str
    created: int
    gen: Generation  # submitted
    num_prompt: int
    opts: ReplyOptions  # how the reply's text splits into content, reasoning and tool calls


async def start_chat(
    body: ChatCompletionRequest,
    req_id: str,
    backend: Backend,
    settings: Settings,
    metrics: Metrics,
    prompt_param: str = "messages",
) -> ChatRun:
    """Validate, render, tokenize (off the event loop) and submit; APIError on bad input
    (`prompt_param` names the conversation in it: /v1/responses calls it `input`)."""
    engine_request, opts = await prepare_chat(body, req_id, backend, settings, prompt_param)
    prompt_ids = engine_request.prompt_ids
    log_request(settings, req_id, body.messages, len(prompt_ids), n=body.n, stream=body.stream)
    gen = Generation(
        backend,
        metrics,
        [engine_request],
        body.stop_list,
        settings.request_timeout,
        body.logprobs,
        max_buffered=settings.stream_buffer,
        prompt_param=prompt_param,
    )
    gen.submit()
    return ChatRun(req_id, int(time.time()), gen, len(prompt_ids), opts)


async def prepare_chat(
    body: ChatCompletionRequest,
    req_id: str,
    backend: Backend,
    settings: Settings,
    prompt_param: str = "messages",
) -> tuple[EngineRequest, ReplyOptions]:
    """Everything start_chat does before it submits: the engine request it would submit
    (also what /v1/chat/completions/render returns)."""
    check_model(body.model, backend)
    check_generative(backend)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    reject_unsupported(body, CHAT_RULES)
    reject_non_text_messages(body.messages)
    check_tool_choice(body.tools, body.tool_choice)
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message needs add_generation_prompt: false",
            param="continue_final_message",
        )
    # NOTE: off the event loop: a long prompt takes a while to render and tokenize
    prompt_ids, n_keep = await run_in_threadpool(
        tokenize_chat,
        backend,
        body.messages,
        body.add_generation_prompt,
        template_kwargs(body),
        body.continue_final_message,
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
    engine_request = make_request(
        req_id,
        prompt_ids,
        body,
        backend=backend,
        settings=settings,
        max_tokens=max_tokens,
        default_max_tokens=None,  # the context's room
        n_keep=n_keep,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        prompt_param=prompt_param,
        grammar=grammar,
    )
    return engine_request, opts


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
