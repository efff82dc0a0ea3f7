"""A choice's generated text -> the assistant message: reasoning, content, tool calls.

`ReplyOptions` says what to look for; `whole_reply` shapes a finished text (JSON responses),
`ReplyStream` the deltas of a stream. Reusable by any route that answers as an assistant.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.reasoning import ReasoningSplitter, split_reply
from server.schemas_out import (
    AssistantMessage,
    ChatDelta,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)
from server.tool_parsers import ToolCall as ParsedCall
from server.tool_parsers import ToolCallStream, parse_reply


@dataclass(slots=True, frozen=True)
class ReplyOptions:
    tool_format: str | None = None  # parse tool calls in this format (tool_parsers); None: no
    parallel_tool_calls: bool = True
    thinking: bool = False  # the prompt opened a <think> block (server.reasoning)


def finish_reason(reason: str, calls: list[ParsedCall]) -> str:
    return "tool_calls" if calls and reason == "stop" else reason


def whole_reply(text: str, reason: str, opts: ReplyOptions) -> tuple[AssistantMessage, str]:
    """-> (the message, the finish_reason: "tool_calls" when it called tools)."""
    split = split_reply(text, opts.thinking)
    content: str | None = split.content
    calls: list[ParsedCall] = []
    if opts.tool_format is not None:
        parsed = parse_reply(split.content, opts.tool_format)
        content, calls = parsed.content, _limit(parsed.tool_calls, opts)
    reasoning = split.reasoning or None
    message = AssistantMessage(
        content=content,
        tool_calls=[_out(c) for c in calls] or None,
        reasoning_content=reasoning,
        reasoning=reasoning,
    )
    return message, finish_reason(reason, calls)


class ReplyStream:
    """One choice's stream: text deltas in, ChatDelta pieces out (reasoning, content, and
    tool calls once they are complete: index, id and name first, then the arguments)."""

    def __init__(self, opts: ReplyOptions) -> None:
        self.opts = opts
        self._reasoning = ReasoningSplitter(opts.thinking)
        self._tools = ToolCallStream(opts.tool_format) if opts.tool_format else None

    def feed(self, text: str) -> list[ChatDelta]:
        split = self._reasoning.feed(text)
        return self._deltas(split.reasoning, split.content)

    def finish(self, reason: str) -> tuple[list[ChatDelta], str]:
        """-> (the last deltas, the finish_reason)."""
        split = self._reasoning.finish()
        deltas = self._deltas(split.reasoning, split.content)
        calls: list[ParsedCall] = []
        if self._tools is not None:
            rest, calls = self._tools.finish()
            calls = _limit(calls, self.opts)
            if rest:
                deltas.append(ChatDelta(content=rest))
            for i, call in enumerate(calls):
                head = FunctionCallDelta(name=call.name, arguments="")
                args = FunctionCallDelta(arguments=call.arguments)
                deltas.append(
                    ChatDelta(
                        tool_calls=[
                            ToolCallDelta(index=i, id=call.id, type="function", function=head)
                        ]
                    )
                )
                deltas.append(ChatDelta(tool_calls=[ToolCallDelta(index=i, function=args)]))
        return deltas, finish_reason(reason, calls)

    def _deltas(self, reasoning: str, content: str) -> list[ChatDelta]:
        out = []
        if reasoning:
            out.append(ChatDelta(reasoning_content=reasoning, reasoning=reasoning))
        if content and self._tools is not None:
            content = self._tools.feed(content)
        if content:
            out.append(ChatDelta(content=content))
        return out


def _limit(calls: list[ParsedCall], opts: ReplyOptions) -> list[ParsedCall]:
    return calls if opts.parallel_tool_calls else calls[:1]


def _out(call: ParsedCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
