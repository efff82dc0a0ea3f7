"""The answers of /v1/messages, from the chat pipeline's reply: a whole Message, or Anthropic's
stream of events.

Stream order (Anthropic's): message_start, ping; per content block content_block_start,
content_block_delta... (text_delta, thinking_delta, input_json_delta), content_block_stop;
then message_delta (stop_reason, stop_sequence, the usage) and message_stop. An engine
failure ends the stream with an `error` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent

from server.chat_reply import ReplyOptions, ReplyStream
from server.deps import dump_json, on_client_gone
from server.errors import anthropic_error_body
from server.generation import Generation, GenerationError
from server.schemas_anthropic import (
    BlockDeltaEvent,
    BlockStartEvent,
    BlockStopEvent,
    ContentBlock,
    InputJsonDelta,
    Message,
    MessageDeltaEvent,
    MessageStartEvent,
    MessageStopEvent,
    MessageUsage,
    PingEvent,
    StopDelta,
    StopReason,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
)
from server.schemas_out import AssistantMessage, ChatDelta


def stop_reason(finish_reason: str, stop_string: str | None) -> tuple[StopReason, str | None]:
    """The chat pipeline's finish_reason (after tool parsing) -> (stop_reason, stop_sequence)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    """The parser hands over a JSON object's text (server.tool_parsers._calls)."""
    value = json.loads(arguments)
    return value if isinstance(value, dict) else {}


def content_blocks(message: AssistantMessage) -> list[ContentBlock]:
    blocks: list[ContentBlock] = []
    if message.reasoning_content:
        blocks.append(ThinkingBlock(thinking=message.reasoning_content))
    if message.content:
        blocks.append(TextBlock(text=message.content))
    for call in message.tool_calls or []:
        args = tool_input(call.function.arguments)
        blocks.append(ToolUseBlock(id=call.id, name=call.function.name, input=args))
    return blocks


def whole_message(
    msg_id: str,
    model: str,
    message: AssistantMessage,
    reason: str,
    stop_string: str | None,
    gen: Generation,
) -> Message:
    stop, sequence = stop_reason(reason, stop_string)
    return Message(
        id=msg_id,
        content=content_blocks(message),
        model=model,
        stop_reason=stop,
        stop_sequence=sequence,
        usage=MessageUsage.of(*gen.usage()),
    )


class EventWriter:
    """Opens and closes content blocks as the reply's pieces arrive; one block is open at once."""

    def __init__(self) -> None:
        self.index = -1  # the open (or last) block's index
        self.kind: str | None = None  # "text" | "thinking" | "tool_use" while a block is open

    def piece(self, d: ChatDelta) -> list[BaseModel]:
        out: list[BaseModel] = []
        if d.reasoning_content:
            out += self._text("thinking", d.reasoning_content)
        if d.content:
            out += self._text("text", d.content)
        for tc in d.tool_calls or []:
            if tc.id is not None:
                block = ToolUseBlock(id=tc.id, name=tc.function.name or "", input={})
                out += self._open("tool_use", block)
            if tc.function.arguments and self.kind == "tool_use":
                delta = InputJsonDelta(partial_json=tc.function.arguments)
                out.append(BlockDeltaEvent(index=self.index, delta=delta))
        return out

    def close(self) -> list[BaseModel]:
        if self.kind is None:
            return []
        self.kind = None
        return [BlockStopEvent(index=self.index)]

    def _text(self, kind: str, text: str) -> list[BaseModel]:
        out: list[BaseModel] = []
        if self.kind != kind:
            block = ThinkingBlock(thinking="") if kind == "thinking" else TextBlock(text="")
            out += self._open(kind, block)
        delta = ThinkingDelta(thinking=text) if kind == "thinking" else TextDelta(text=text)
        out.append(BlockDeltaEvent(index=self.index, delta=delta))
        return out

    def _open(self, kind: str, block: ContentBlock) -> list[BaseModel]:
        out = self.close()
        self.index += 1
        self.kind = kind
        out.append(BlockStartEvent(index=self.index, content_block=block))
        return out


async def message_events(
    gen: Generation, msg_id: str, num_prompt: int, opts: ReplyOptions
) -> AsyncIterator[BaseModel]:
    # NOTE: the prefix-cache hit is known only when the engine finishes the request: the
    # start counts the whole prompt as input, message_delta carries the final split
    start_usage = MessageUsage(input_tokens=num_prompt, output_tokens=0)
    start = Message(id=msg_id, content=[], model=gen.backend.model_name, usage=start_usage)
    yield MessageStartEvent(message=start)
    yield PingEvent()
    writer = EventWriter()
    reply = ReplyStream(opts)
    reason, stop_string = "stop", None
    async for d in gen.deltas():
        for piece in reply.feed(d.text) if d.text else []:
            for event in writer.piece(piece):
                yield event
        if d.finish_reason is not None:
            last, reason = reply.finish(d.finish_reason)
            stop_string = d.stop_string
            for piece in last:
                for event in writer.piece(piece):
                    yield event
    for event in writer.close():
        yield event
    stop, sequence = stop_reason(reason, stop_string)
    usage = MessageUsage.of(*gen.usage())
    yield MessageDeltaEvent(delta=StopDelta(stop_reason=stop, stop_sequence=sequence), usage=usage)
    yield MessageStopEvent()


def _ping() -> ServerSentEvent:
    return ServerSentEvent(event="ping", data=json.dumps({"type": "ping"}))


def messages_sse(
    gen: Generation, msg_id: str, num_prompt: int, opts: ReplyOptions
) -> EventSourceResponse:
    """Named SSE events (`event: <type>`), Anthropic's pings while the model is quiet."""

    async def stream() -> AsyncIterator[dict[str, str]]:
        try:
            async for event in message_events(gen, msg_id, num_prompt, opts):
                yield {"event": event.type, "data": dump_json(event)}  # type: ignore[attr-defined]
        except GenerationError as exc:
            body = anthropic_error_body(exc.status, str(exc))
            yield {"event": "error", "data": json.dumps(body)}
        finally:
            gen.cancel()

    return EventSourceResponse(
        stream(),
        ping=15,
        ping_message_factory=_ping,
        client_close_handler_callable=on_client_gone(gen),
    )
