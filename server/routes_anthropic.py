"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API over the chat
pipeline (server/anthropic_input.py translates the body; anthropic_output.py answers in
Anthropic's shapes; server/errors.py gives this prefix Anthropic's error shape)."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from server.anthropic_input import count_tokens_request, to_chat_request
from server.anthropic_output import messages_sse, whole_message
from server.auth import check_api_key
from server.chat_reply import whole_reply
from server.chat_run import start_chat, template_kwargs
from server.deps import BackendDep, MetricsDep, SettingsDep, check_model, collect
from server.prompts import tokenize_chat
from server.schemas_anthropic import CountTokensRequest, CountTokensResponse, MessagesRequest

router = APIRouter(dependencies=[Depends(check_api_key)], tags=["anthropic"])


@router.post("/v1/messages")
async def create_message(
    body: MessagesRequest,
    request: Request,
    backend: BackendDep,
    settings: SettingsDep,
    metrics: MetricsDep,
) -> Any:
    chat = to_chat_request(body)
    msg_id = f"msg_{uuid.uuid4().hex}"
    run = await start_chat(chat, msg_id, backend, settings, metrics)
    if body.stream:
        return messages_sse(run.gen, msg_id, run.num_prompt, run.opts)
    [result] = await collect(run.gen, request, [""])
    message, reason = whole_reply(result.text, result.finish_reason or "stop", run.opts)
    return whole_message(msg_id, backend.model_name, message, reason, result.stop_string, run.gen)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, backend: BackendDep) -> CountTokensResponse:
    """The prompt length /v1/messages would submit for the same body (the same template)."""
    check_model(body.model, backend)
    chat = count_tokens_request(body)
    ids, _ = await run_in_threadpool(
        tokenize_chat,
        backend,
        chat.messages,
        chat.add_generation_prompt,
        template_kwargs(chat),
        chat.continue_final_message,
    )
    return CountTokensResponse(input_tokens=len(ids))
