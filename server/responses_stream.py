"""The stream of /v1/responses: the chat pipeline's reply pieces -> OpenAI's events.

Order (OpenAI's): response.created, response.in_progress; then per output item
response.output_item.added, its content (a message: response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done; reasoning:
the same with response.reasoning_text.*; a function call: response.function_call_arguments.delta
and .done), response.output_item.done; last response.completed (response.incomplete at
max_output_tokens). Every event carries the next `sequence_number`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import EventSourceResponse

from server.chat_reply import ReplyOptions, ReplyStream
from server.deps import dump_json, on_client_gone
from server.errors import error_body
from server.generation import Generation, GenerationError
from server.responses_output import ResponseBuilder, new_id, status_of
from server.schemas_out import ChatDelta
from server.schemas_responses_out import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    FunctionCall,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseEvent,
    TextDeltaEvent,
    TextDoneEvent,
)


class EventWriter:
    """Opens and closes output items as the reply's pieces arrive; one item is open at once."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.b = builder
        self.seq = 0
        self.items: list[OutputItem] = []
        self.kind: str | None = None  # "message" | "reasoning" | "function_call" while open
        self.item_id = ""
        self.text = ""
        self.call: FunctionCall | None = None

    def _next(self) -> int:
        self.seq += 1
        return self.seq - 1

    def start(self) -> list[Any]:
        r = self.b.response("in_progress", [])
        return [
            ResponseEvent(type="response.created", sequence_number=self._next(), response=r),
            ResponseEvent(type="response.in_progress", sequence_number=self._next(), response=r),
        ]

    def piece(self, d: ChatDelta) -> list[Any]:
        out: list[Any] = []
        if d.reasoning_content:
            out += self._text("reasoning", d.reasoning_content)
        if d.content:
            out += self._text("message", d.content)
        for tc in d.tool_calls or []:
            if tc.id is not None:
                out += self._open_call(tc.id, tc.function.name or "")
            if tc.function.arguments and self.call is not None:
                self.call.arguments += tc.function.arguments
                out.append(
                    ArgumentsDeltaEvent(
                        sequence_number=self._next(),
                        item_id=self.item_id,
                        output_index=len(self.items),
                        delta=tc.function.arguments,
                    )
                )
        return out

    def finish(self, reason: str, gen: Generation) -> list[Any]:
        status = status_of(reason)
        out = self._close(status)
        if not self.items:  # no text at all: still one (empty) message
            out += self._open("message") + self._close(status)
        final = self.b.final(self.items, reason, gen)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        out.append(ResponseEvent(type=kind, sequence_number=self._next(), response=final))
        return out

    def _ids(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": len(self.items), "content_index": 0}

    def _text(self, kind: str, delta: str) -> list[Any]:
        out = [] if self.kind == kind else self._close("completed") + self._open(kind)
        self.text += delta
        event = ReasoningDeltaEvent if kind == "reasoning" else TextDeltaEvent
        out.append(event(sequence_number=self._next(), delta=delta, **self._ids()))
        return out

    def _open(self, kind: str) -> list[Any]:
        self.kind, self.text = kind, ""
        self.item_id = new_id("rs" if kind == "reasoning" else "msg")
        item = self._item("in_progress")
        part = ReasoningText(text="") if kind == "reasoning" else OutputText(text="")
        return [
            OutputItemEvent(
                type="response.output_item.added",
                sequence_number=self._next(),
                output_index=len(self.items),
                item=item.model_copy(update={"content": []}),
            ),
            ContentPartEvent(
                type="response.content_part.added",
                sequence_number=self._next(),
                part=part,
                **self._ids(),
            ),
        ]

    def _open_call(self, call_id: str, name: str) -> list[Any]:
        out = self._close("completed")
        self.kind, self.item_id = "function_call", new_id("fc")
        self.call = FunctionCall(
            id=self.item_id, call_id=call_id, name=name, arguments="", status="in_progress"
        )
        out.append(
            OutputItemEvent(
                type="response.output_item.added",
                sequence_number=self._next(),
                output_index=len(self.items),
                item=self.call.model_copy(),
            )
        )
        return out

    def _item(self, status: Any) -> OutputItem:
        if self.kind == "reasoning":
            text = ReasoningText(text=self.text)
            return ReasoningItem(id=self.item_id, content=[text], status=status)
        return OutputMessage(id=self.item_id, status=status, content=[OutputText(text=self.text)])

    def _close(self, status: Any) -> list[Any]:
        if self.kind is None:
            return []
        out: list[Any] = []
        if self.kind == "function_call" and self.call is not None:
            item: OutputItem = self.call.model_copy(update={"status": "completed"})
            out.append(
                ArgumentsDoneEvent(
                    sequence_number=self._next(),
                    item_id=self.item_id,
                    output_index=len(self.items),
                    arguments=self.call.arguments,
                )
            )
            self.call = None
        else:
            reasoning = self.kind == "reasoning"
            done = ReasoningDoneEvent if reasoning else TextDoneEvent
            part = ReasoningText(text=self.text) if reasoning else OutputText(text=self.text)
            item = self._item(status)
            out.append(done(sequence_number=self._next(), text=self.text, **self._ids()))
            out.append(
                ContentPartEvent(
                    type="response.content_part.done",
                    sequence_number=self._next(),
                    part=part,
                    **self._ids(),
                )
            )
        out.append(
            OutputItemEvent(
                type="response.output_item.done",
                sequence_number=self._next(),
                output_index=len(self.items),
                item=item,
            )
        )
        self.items.append(item)
        self.kind = None
        return out


async def response_events(
    gen: Generation, builder: ResponseBuilder, opts: ReplyOptions
) -> AsyncIterator[Any]:
    writer = EventWriter(builder)
    reply = ReplyStream(opts)
    for event in writer.start():
        yield event
    reason = "stop"
    async for d in gen.deltas():
        for piece in reply.feed(d.text) if d.text else []:
            for event in writer.piece(piece):
                yield event
        if d.finish_reason is not None:
            last, reason = reply.finish(d.finish_reason)
            for piece in last:
                for event in writer.piece(piece):
                    yield event
    for event in writer.finish(reason, gen):
        yield event


def responses_sse(
    gen: Generation, builder: ResponseBuilder, opts: ReplyOptions
) -> EventSourceResponse:
    """Named SSE events (`event: <type>`); an engine failure ends the stream with `error`
    and response.failed."""

    async def stream() -> AsyncIterator[dict[str, str]]:
        num_sent = 0
        try:
            async for event in response_events(gen, builder, opts):
                num_sent = event.sequence_number + 1
                yield {"event": event.type, "data": dump_json(event)}
        except GenerationError as exc:
            err = error_body(exc.status, str(exc), code=exc.code)["error"]
            error = ErrorEvent(sequence_number=num_sent, code=exc.code, message=str(exc), error=err)
            yield {"event": "error", "data": dump_json(error)}
            failed = builder.response(
                "failed", [], error=ResponseError(code=exc.code, message=str(exc))
            )
            end = ResponseEvent(
                type="response.failed", sequence_number=num_sent + 1, response=failed
            )
            yield {"event": end.type, "data": dump_json(end)}
        finally:
            gen.cancel()

    return EventSourceResponse(stream(), ping=15, client_close_handler_callable=on_client_gone(gen))
