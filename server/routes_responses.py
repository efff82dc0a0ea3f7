"""POST /v1/responses: OpenAI's Responses API, stateless, over the chat pipeline.

A stream sends OpenAI's events in OpenAI's order, each with its `sequence_number`:
response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, response.output_item.done, then response.completed (or
response.incomplete at max_output_tokens). A failure mid-stream sends `error`, then
response.failed.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from sse_starlette import EventSourceResponse

from server.auth import check_api_key
from server.chat_run import start_chat
from server.deps import BackendDep, MetricsDep, SettingsDep, collect, dump_json
from server.errors import error_body
from server.generation import Generation, GenerationAborted, GenerationFailed, GenerationTimeout
from server.responses_input import to_chat_request
from server.schemas_responses import ResponsesRequest
from server.schemas_responses_out import (
    ContentPartEvent,
    ErrorEvent,
    IncompleteDetails,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponseUsage,
    Status,
    TextDeltaEvent,
    TextDoneEvent,
)

log = logging.getLogger("cellserve.server")
router = APIRouter(dependencies=[Depends(check_api_key)], tags=["openai"])


class ResponseBuilder:
    """The Response object at each stage, echoing the request's settings as OpenAI does."""

    def __init__(self, body: ResponsesRequest, resp_id: str, created: int, model: str) -> None:
        self.body = body
        self.resp_id = resp_id
        self.created = created
        self.model = model
        self.msg_id = f"msg_{uuid.uuid4().hex}"

    def response(
        self,
        status: Status,
        output: list[OutputItem],
        usage: ResponseUsage | None = None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        body = self.body
        text: dict[str, Any] = {"format": {"type": "text"}}
        if body.text is not None and body.text.format is not None:
            text = {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
        incomplete = (
            IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        )
        return ResponseObject(
            id=self.resp_id,
            created_at=self.created,
            status=status,
            error=error,
            incomplete_details=incomplete,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=self.model,
            output=output,
            parallel_tool_calls=True
            if body.parallel_tool_calls is None
            else body.parallel_tool_calls,
            temperature=body.temperature,
            text=text,
            tool_choice=body.tool_choice or "auto",
            tools=body.tools or [],
            top_p=body.top_p,
            usage=usage,
            user=body.user,
            metadata=body.metadata or {},
        )

    def message(self, text: str | None, status: Status) -> OutputMessage:
        content = [] if text is None else [OutputText(text=text)]
        return OutputMessage(id=self.msg_id, status=status, content=content)

    def final(self, text: str, finish_reason: str | None, gen: Generation) -> ResponseObject:
        status: Status = "incomplete" if finish_reason == "length" else "completed"
        num_input, num_output, num_cached = gen.usage()
        usage = ResponseUsage.of(num_input, num_output, num_cached)
        return self.response(status, [self.message(text, status)], usage)


@router.post("/v1/responses")
async def create_response(
    body: ResponsesRequest,
    request: Request,
    backend: BackendDep,
    settings: SettingsDep,
    metrics: MetricsDep,
) -> Any:
    chat = to_chat_request(body)
    resp_id = f"resp_{uuid.uuid4().hex}"
    run = await start_chat(chat, resp_id, backend, settings, metrics, prompt_param="input")
    builder = ResponseBuilder(body, resp_id, run.created, backend.model_name)
    if body.stream:
        return _sse(run.gen, builder)
    [result] = await collect(run.gen, request, [""])
    return builder.final(result.text, result.finish_reason, run.gen)


async def _events(gen: Generation, b: ResponseBuilder) -> AsyncIterator[Any]:
    seq = itertools.count()
    yield ResponseEvent(
        type="response.created", sequence_number=next(seq), response=b.response("in_progress", [])
    )
    yield ResponseEvent(
        type="response.in_progress",
        sequence_number=next(seq),
        response=b.response("in_progress", []),
    )
    ids = {"item_id": b.msg_id, "output_index": 0, "content_index": 0}
    yield OutputItemEvent(
        type="response.output_item.added",
        sequence_number=next(seq),
        output_index=0,
        item=b.message(None, "in_progress"),
    )
    yield ContentPartEvent(
        type="response.content_part.added",
        sequence_number=next(seq),
        part=OutputText(text=""),
        **ids,
    )
    text, reason = "", None
    async for d in gen.deltas():
        if d.text:
            text += d.text
            yield TextDeltaEvent(sequence_number=next(seq), delta=d.text, **ids)
        reason = d.finish_reason or reason
    final = b.final(text, reason, gen)
    yield TextDoneEvent(sequence_number=next(seq), text=text, **ids)
    yield ContentPartEvent(
        type="response.content_part.done",
        sequence_number=next(seq),
        part=OutputText(text=text),
        **ids,
    )
    yield OutputItemEvent(
        type="response.output_item.done",
        sequence_number=next(seq),
        output_index=0,
        item=final.output[0],
    )
    done = "response.incomplete" if final.status == "incomplete" else "response.completed"
    yield ResponseEvent(type=done, sequence_number=next(seq), response=final)


def _sse(gen: Generation, b: ResponseBuilder) -> EventSourceResponse:
    """Named SSE events (`event: <type>`); an engine failure ends the stream with `error`
    and response.failed."""

    async def stream() -> AsyncIterator[dict[str, str]]:
        num_sent = 0
        try:
            async for event in _events(gen, b):
                num_sent = event.sequence_number + 1
                yield {"event": event.type, "data": dump_json(event)}
        except (GenerationTimeout, GenerationFailed, GenerationAborted) as exc:
            status, code = {
                GenerationTimeout: (504, "request_timeout"),
                GenerationFailed: (500, "engine_error"),
                GenerationAborted: (503, "aborted"),
            }[type(exc)]
            err = error_body(status, str(exc), code=code)["error"]
            error = ErrorEvent(sequence_number=num_sent, code=code, message=str(exc), error=err)
            yield {"event": "error", "data": dump_json(error)}
            failed = b.response("failed", [], error=ResponseError(code=code, message=str(exc)))
            end = ResponseEvent(
                type="response.failed", sequence_number=num_sent + 1, response=failed
            )
            yield {"event": end.type, "data": dump_json(end)}
        finally:
            gen.cancel()

    async def client_gone(_: object) -> None:
        log.info("client gone: aborting %s", gen.requests[0].req_id)
        gen.cancel()

    return EventSourceResponse(stream(), ping=15, client_close_handler_callable=client_gone)
