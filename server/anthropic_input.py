"""A /v1/messages body -> the ChatCompletionRequest that the chat pipeline runs.

`system` (a string or text blocks) becomes a system message. A user message's text blocks
become a user message and each `tool_result` block a tool message; an assistant message's text
blocks its content and its `tool_use` blocks its tool calls. A final assistant message is a
prefill: the reply continues it (the chat pipeline's continue_final_message). `thinking`
blocks sent back are skipped (the model re-reads the conversation; nothing is signed).
`cache_control` marks are accepted and need nothing: the prefix cache reuses any prompt
prefix it still holds.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from server.errors import APIError
from server.schemas import ChatCompletionRequest
from server.schemas_anthropic import CountTokensRequest, MessagesRequest, ToolChoice
from server.unsupported import Rule, given, reject_unsupported

MESSAGES_RULES: dict[str, Rule] = {
    "mcp_servers": (given, "MCP servers are not supported: send client tools"),
    "container": (given, "code-execution containers are not supported"),
    "context_management": (given, "context management is not supported"),
}
SKIPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})
# Anthropic's effort levels above "high" run as "high" (the chat templates know three)
EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def _unsupported(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="unsupported_parameter")


def _block_type(block: Any, param: str) -> str:
    if not isinstance(block, dict):
        raise APIError(400, f"{param}: a content block is an object", param=param)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise APIError(400, f"{param}.type: a block needs a type", param=f"{param}.type")
    return kind


def _text(block: dict[str, Any], param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise APIError(400, f"{param}.text: a string is required", param=f"{param}.text")
    return text


def _not_readable(kind: str, param: str) -> APIError:
    return APIError(
        400,
        f"{param}.type: {kind!r} blocks are not supported: this model reads text only",
        param=f"{param}.type",
        code="unsupported_content",
    )


def text_of(content: str | list[dict[str, Any]], param: str) -> str:
    """A string, or the text of a list of text blocks (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        where = f"{param}.{j}"
        kind = _block_type(block, where)
        if kind != "text":
            raise _not_readable(kind, where)
        texts.append(_text(block, where))
    return "".join(texts)


def _user_messages(content: list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        where = f"{param}.{j}"
        kind = _block_type(block, where)
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "".join(texts)})
                texts = []
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise APIError(
                    400, f"{where}.tool_use_id: a string is required", param=f"{where}.tool_use_id"
                )
            result = block.get("content", "")
            if not isinstance(result, str | list):
                raise APIError(
                    400, f"{where}.content: a string or text blocks", param=f"{where}.content"
                )
            text = text_of(result, f"{where}.content")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind in SKIPPED_BLOCKS:
            continue
        else:
            raise _not_readable(kind, where)
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant_message(content: list[dict[str, Any]], param: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{param}.{j}"
        kind = _block_type(block, where)
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise APIError(400, f"{where}: tool_use needs an id and a name", param=where)
            if not isinstance(args, dict):
                raise APIError(400, f"{where}.input: an object", param=f"{where}.input")
            function = {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}
            calls.append({"id": call_id, "type": "function", "function": function})
        elif kind in SKIPPED_BLOCKS:
            continue
        else:
            raise _not_readable(kind, where)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.system is not None:
        system = text_of(body.system, "system")
        if system:
            messages.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        param = f"messages.{i}.content"
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            messages += _user_messages(m.content, param)
        else:
            messages.append(_assistant_message(m.content, param))
    final = messages[-1]
    if final["role"] == "assistant" and (final.get("tool_calls") or not final["content"]):
        raise APIError(
            400,
            "a final assistant message (prefill) must be text",
            param=f"messages.{len(body.messages) - 1}.content",
        )
    if final["role"] == "assistant" and final["content"] != final["content"].rstrip():
        raise APIError(  # Anthropic's own rule
            400,
            "final assistant content cannot end with trailing whitespace",
            param=f"messages.{len(body.messages) - 1}.content",
        )
    return messages


def chat_tools(body: CountTokensRequest) -> list[dict[str, Any]]:
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.type not in (None, "custom"):
            raise _unsupported(
                f"tools.{i}.type", f"{tool.type!r} tools are not supported: client tools only"
            )
        if tool.input_schema is None:
            raise APIError(
                400, f"tools.{i}.input_schema: required", param=f"tools.{i}.input_schema"
            )
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.strict is not None:
            function["strict"] = tool.strict
        tools.append({"type": "function", "function": function})
    return tools


def chat_tool_choice(choice: ToolChoice | None, tool_names: list[str]) -> str | dict | None:
    if choice is None:
        return None
    if choice.type in ("any", "tool") and not tool_names:
        raise APIError(400, f"tool_choice: {choice.type!r} needs tools", param="tool_choice")
    if choice.type == "tool":
        if choice.name not in tool_names:
            raise APIError(
                400, f"tool_choice.name: no tool named {choice.name!r}", param="tool_choice.name"
            )
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_fields(body: CountTokensRequest) -> dict[str, Any]:
    """What the prompt depends on: messages, tools, template kwargs (shared with count_tokens)."""
    reject_unsupported(body, MESSAGES_RULES)
    messages = chat_messages(body)
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if messages[-1]["role"] == "assistant":  # prefill: the reply continues it
        chat |= {"add_generation_prompt": False, "continue_final_message": True}
    tools = chat_tools(body)
    if tools:
        chat["tools"] = tools
    choice = chat_tool_choice(body.tool_choice, [t["function"]["name"] for t in tools])
    if choice is not None:
        chat["tool_choice"] = choice
        chat["parallel_tool_calls"] = not body.tool_choice.disable_parallel_tool_use  # type: ignore[union-attr]
    if body.thinking is not None:
        # Qwen3's and the hybrid reasoners' switch; templates without it ignore the kwarg
        chat["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    out = body.output_config
    if out is not None and out.effort is not None:
        chat["reasoning_effort"] = EFFORT[out.effort]
    if out is not None and out.format is not None:
        schema = {"name": "output", "schema": out.format.schema_}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    return chat


def _validated(chat: dict[str, Any]) -> ChatCompletionRequest:
    names = {"max_tokens": "max_tokens", "stop": "stop_sequences"}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        if loc:
            loc[0] = names.get(loc[0], loc[0])
        where = ".".join(loc)
        raise APIError(400, f"{where}: {first.get('msg')}", param=where or None) from exc


def count_tokens_request(body: CountTokensRequest) -> ChatCompletionRequest:
    return _validated(chat_fields(body))


def to_chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat body for `body`; APIError (400) naming the field that cannot be served."""
    chat = chat_fields(body)
    chat |= {
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stream": body.stream,
    }
    if body.stop_sequences:
        chat["stop"] = body.stop_sequences
    return _validated(chat)
