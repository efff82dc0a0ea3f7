"""Tool calls out of a model's reply, per template family (model/load/tool_prompt.py's formats).

- hermes (Hermes, Qwen 2.5/3, and cellserve's rendering for templates without tools):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call;
- llama3 (Llama 3.1-3.3 JSON tool calling): `{"name": ..., "parameters": {...}}`, several
  joined by `;`, optionally after `<|python_tag|>`;
- mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (the marker is a control
  token the detokenizer drops, so a bare JSON array at the start counts too).

A reply whose calls do not parse is left as plain content (vLLM's behaviour).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from model.load.tool_prompt import HERMES, LLAMA3, MISTRAL

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
# text that, at the start of a reply, means "tool calls follow" (held back while streaming)
START_MARKERS = {
    HERMES: ("<tool_call>",),
    LLAMA3: ("<|python_tag|>", "{"),
    MISTRAL: ("[TOOL_CALLS]", "["),
}


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(slots=True)
class ParsedReply:
    content: str | None
    tool_calls: list[ToolCall]


def parse_reply(text: str, fmt: str) -> ParsedReply:
    """Splits a finished reply into content and tool calls; no calls when they do not parse."""
    calls: list[ToolCall] | None
    content = text
    if fmt == HERMES:
        start = text.find("<tool_call>")
        if start < 0:
            return ParsedReply(text, [])
        content = text[:start].strip()
        blocks = [
            (m.group(1), m.group(0).endswith("</tool_call>"))
            for m in _HERMES_CALL.finditer(text, start)
        ]
        calls = _calls([b for b, _ in blocks])
        if calls is None and len(blocks) > 1 and not blocks[-1][1]:
            calls = _calls([b for b, _ in blocks[:-1]])  # cut short by max_tokens: drop it
    elif fmt == LLAMA3:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return ParsedReply(text, [])
        calls, content = _calls([p for p in body.split(";") if p.strip()]), ""
    elif fmt == MISTRAL:
        body = text.strip().removeprefix("[TOOL_CALLS]").strip()
        if not body.startswith("["):
            return ParsedReply(text, [])
        try:
            items = json.loads(body)
        except ValueError:
            return ParsedReply(text, [])
        calls, content = (
            _calls([json.dumps(i) for i in items] if isinstance(items, list) else []),
            "",
        )
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}")
    if not calls:
        return ParsedReply(text, [])
    return ParsedReply(content or None, calls)


def _calls(payloads: list[str]) -> list[ToolCall] | None:
    """JSON objects {"name", "arguments" | "parameters"} -> calls; None if any is malformed."""
    calls = []
    for payload in payloads:
        try:
            obj: Any = json.loads(payload)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)))
    return calls


class ToolCallStream:
    """Streaming side: content passes through until the reply starts a tool call; from then on
    the text is held and parsed when the choice ends (`finish`). For hermes, content before
    the first `<tool_call>` is streamed; for llama3 / mistral a reply is a call only when it
    starts with one."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self._markers = START_MARKERS[fmt]
        self._seen = ""  # everything fed so far
        self._sent = 0  # length of the prefix of _seen streamed as content
        self.in_call = False

    def feed(self, text: str) -> str:
        """-> content safe to stream now."""
        self._seen += text
        if self.in_call:
            return ""
        if self.fmt == HERMES:
            marker = self._markers[0]
            start = self._seen.find(marker, self._sent)
            if start >= 0:
                self.in_call = True
                return self._emit(start)
            return self._emit(len(self._seen) - _partial(self._seen, marker))
        head = self._seen.lstrip()
        if not head:
            return ""
        if any(head.startswith(m) for m in self._markers):
            self.in_call = True
            return ""
        if any(m.startswith(head) for m in self._markers):
            return ""  # may still become a marker
        return self._emit(len(self._seen))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """-> (content not streamed yet, the calls). Unparseable calls come back as content."""
        if not self.in_call:
            return self._emit(len(self._seen)), []
        reply = parse_reply(self._seen, self.fmt)
        if not reply.tool_calls:
            return self._emit(len(self._seen)), []
        return "", reply.tool_calls  # hermes: the content before the calls was streamed

    def _emit(self, end: int) -> str:
        out = self._seen[self._sent : end]
        self._sent = max(self._sent, end)
        return out


def _partial(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
