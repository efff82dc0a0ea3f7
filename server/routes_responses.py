"""POST /v1/responses: OpenAI's Responses API, stateless, over the chat pipeline
(server/responses_input.py translates the body; responses_output.py and responses_stream.py
answer in OpenAI's shapes)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from server.auth import check_api_key
from server.chat_reply import whole_reply
from server.chat_run import start_chat
from server.deps import BackendDep, MetricsDep, SettingsDep, collect
from server.responses_input import to_chat_request
from server.responses_output import ResponseBuilder, new_id
from server.responses_stream import responses_sse
from server.schemas_responses import ResponsesRequest

router = APIRouter(dependencies=[Depends(check_api_key)], tags=["openai"])


@router.post("/v1/responses")
async def create_response(
    body: ResponsesRequest,
    request: Request,
    backend: BackendDep,
    settings: SettingsDep,
    metrics: MetricsDep,
) -> Any:
    chat = to_chat_request(body)
    resp_id = new_id("resp")
    run = await start_chat(chat, resp_id, backend, settings, metrics, prompt_param="input")
    builder = ResponseBuilder(body, resp_id, run.created, backend.model_name)
    if body.stream:
        return responses_sse(run.gen, builder, run.opts)
    [result] = await collect(run.gen, request, [""])
    message, reason = whole_reply(result.text, result.finish_reason or "stop", run.opts)
    return builder.whole(message, reason, run.gen)
