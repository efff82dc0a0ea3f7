"""A /v1/responses body -> the ChatCompletionRequest that the chat pipeline runs.

input items: a string (one user message), or a list of `message` items (roles user, assistant,
system, developer; text content parts), `function_call` items (the model's earlier tool calls,
folded into one assistant message) and `function_call_output` items (tool messages).
`reasoning` items are skipped: nothing is stored, and the model re-reads the conversation.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from server.errors import APIError
from server.schemas import ChatCompletionRequest
from server.schemas_responses import ResponsesRequest
from server.unsupported import Rule, given, reject_unsupported

ROLES = frozenset({"user", "assistant", "system", "developer"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})


def _not_disabled(value: Any, _: Any) -> bool:
    return value not in (None, "disabled")


def _summary_asked(value: Any, _: Any) -> bool:
    return isinstance(value, dict) and value.get("summary") is not None


RESPONSES_RULES: dict[str, Rule] = {
    "store": (given, "store: true is not supported: this server is stateless"),
    "previous_response_id": (given, "this server is stateless: send the whole conversation"),
    "conversation": (given, "this server is stateless: send the whole conversation"),
    "background": (given, "background responses are not supported"),
    "prompt": (given, "stored prompt templates are not supported"),
    "include": (given, "extra output data (include) is not supported"),
    "reasoning": (_summary_asked, "reasoning summaries are not supported"),
    "truncation": (_not_disabled, "only truncation 'disabled' is supported"),
    "top_logprobs": (given, "logprobs are not supported on /v1/responses"),
    "max_tool_calls": (given, "max_tool_calls is not supported"),
}


def _err(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="unsupported_parameter")


def _text_of(content: Any, param: str) -> str:
    """The text of a message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param}: must be a string or a list of parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise _err(f"{param}.{j}.type", f"{kind!r} parts are not supported: text only")
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise APIError(400, f"{param}.{j}.text: must be a string", param=f"{param}.{j}.text")
        texts.append(text)
    return "".join(texts)


def _required(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{param}.{key}: a string is required", param=f"{param}.{key}")
    return value


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        param = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise APIError(400, f"{param}.role: unknown role {role!r}", param=f"{param}.role")
            text = _text_of(item.get("content"), f"{param}.content")
            messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {
                "id": _required(item, "call_id", param),
                "type": "function",
                "function": {
                    "name": _required(item, "name", param),
                    "arguments": _required(item, "arguments", param),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{param}.output")
            call_id = _required(item, "call_id", param)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise _err(f"{param}.type", f"{kind!r} input items are not supported")
    if not messages:
        raise APIError(400, "input: the conversation is empty", param="input")
    return messages


def chat_tools(body: ResponsesRequest) -> list[dict[str, Any]]:
    tools = []
    for i, tool in enumerate(body.tools or []):
        kind = tool.get("type")
        if kind != "function":
            raise _err(f"tools.{i}.type", f"{kind!r} tools are not supported: function only")
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
        }
        tools.append({"type": "function", "function": function})
    return tools


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _err("tool_choice", f"{choice.get('type')!r} is not supported: a function only")


def chat_response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name or "response", "schema": fmt.schema_ or {}, "strict": fmt.strict}
    if fmt.description is not None:
        schema["description"] = fmt.description
    return {"type": "json_schema", "json_schema": schema}


def to_chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat body for `body`; APIError (400) naming the field that cannot be served."""
    reject_unsupported(body, RESPONSES_RULES)
    if body.text is not None and body.text.verbosity is not None:
        raise _err("text.verbosity", "verbosity is not supported")
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": input_messages(body),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "stream": body.stream,
    }
    reasoning = (body.model_extra or {}).get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    # NOTE: tools and structured output go to the chat pipeline only where it declares them;
    # otherwise they would be dropped silently, so they are a 400 instead
    extras = {
        "tools": (chat_tools(body) if body.tools else None, "tools"),
        "tool_choice": (chat_tool_choice(body.tool_choice), "tool_choice"),
        "parallel_tool_calls": (body.parallel_tool_calls, "parallel_tool_calls"),
        "response_format": (chat_response_format(body), "text.format"),
    }
    for name, (value, param) in extras.items():
        if value is None:
            continue
        if name not in ChatCompletionRequest.model_fields:
            raise _err(param, "not supported by this server's chat pipeline")
        chat[name] = value
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"{where}: {first.get('msg')}", param=where or None) from exc
