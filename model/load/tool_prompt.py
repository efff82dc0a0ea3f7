"""Tools in the prompt: which tool-call format a chat template speaks, and the Hermes-style
rendering for a template that knows no tools (SmolLM2-135M-Instruct's, for one).

A template that mentions `tools` gets them as HF's apply_chat_template passes them; for one
that does not, the tools go into the system message, an assistant's `tool_calls` become
`<tool_call>` blocks in its content, and `tool` messages become a user turn of
`<tool_response>` blocks: the Hermes / Qwen 2.5 convention, which the parser then reads.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"

TOOLS_PREAMBLE = (
    "# Tools\n\n"
    "You can call the functions described below, in <tools></tools> tags, to help answer.\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "To call a function, write a JSON object with its name and arguments inside "
    "<tool_call></tool_call> tags, one per call:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n'
    "</tool_call>"
)


def tool_format(source: str) -> str:
    """The tool-call format of the model behind a chat template: HERMES, LLAMA3 or MISTRAL.
    HERMES also for a template without tools (tools are then rendered the Hermes way)."""
    if "[TOOL_CALLS]" in source:
        return MISTRAL
    if "<tool_call>" in source or "tools" not in source:
        return HERMES
    if "<|python_tag|>" in source or "ipython" in source or "<|eom_id|>" in source:
        return LLAMA3
    return HERMES


def arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI sends a tool call's `arguments` as a JSON string; templates (Qwen, Llama 3.1,
    Mistral) write them with `| tojson`, so they get the parsed object, as vLLM does."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            out.append(m)
            continue
        parsed = []
        for call in calls:
            function = dict(call.get("function") or {})
            args = function.get("arguments")
            if isinstance(args, str):
                with contextlib.suppress(ValueError):  # not JSON: the template gets the text
                    function["arguments"] = json.loads(args) if args.strip() else {}
            parsed.append({**call, "function": function})
        out.append({**m, "tool_calls": parsed})
    return out


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """`messages` with tools, tool calls and tool results written as plain text (see module)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "tool":
            block = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if out and out[-1].get("_tool_turn"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_turn": True})
            continue
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            blocks = [_call_block(c) for c in calls]
            content = _text(m.get("content"))
            text = "\n".join(([content] if content else []) + blocks)
            out.append({**{k: v for k, v in m.items() if k != "tool_calls"}, "content": text})
            continue
        out.append(m)
    out = [{k: v for k, v in m.items() if k != "_tool_turn"} for m in out]
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        preamble = TOOLS_PREAMBLE.format(tools=listing)
        if out and out[0].get("role") == "system":
            system = _text(out[0].get("content"))
            out[0] = {**out[0], "content": f"{system}\n\n{preamble}" if system else preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def _call_block(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    payload = {"name": function.get("name"), "arguments": function.get("arguments", {})}
    return f"<tool_call>\n{json.dumps(payload, ensure_ascii=False)}\n</tool_call>"


def _text(content: Any) -> str:
    return content if isinstance(content, str) else "" if content is None else str(content)
