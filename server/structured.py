"""A request's grammar: from response_format / vLLM's and llama.cpp's fields, or from its tools.

Reusable by any route: `body_grammar_spec(body)` and `tool_grammar_spec(...)` give a
GrammarSpec and the parameter it came from; `compile_grammar` turns it into the engine's
Grammar or a 400 naming that parameter.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from model.load.tool_prompt import HERMES, LLAMA3, MISTRAL
from model.runner.grammar import ANY_JSON_OBJECT, JSON_OPTIONS, GrammarError, GrammarSpec
from scheduler.constraint import Grammar
from server.backend import Backend
from server.errors import APIError
from server.schemas import SamplingBody
from server.schemas_tools import NamedToolChoice, Tool, ToolChoice

Spec = tuple[GrammarSpec, str]  # (the grammar, the request parameter it came from)


def body_grammar_spec(body: SamplingBody) -> Spec | None:
    """The structured-output grammar a body asks for, if any; 400 when it asks for two."""
    found: list[Spec] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append((GrammarSpec.json_schema(rf.schema_ or ANY_JSON_OBJECT), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_ if rf.json_schema is not None else rf.schema_
        if schema is None:
            raise APIError(
                400,
                "response_format json_schema needs json_schema.schema",
                param="response_format.json_schema",
            )
        found.append((GrammarSpec.json_schema(schema), "response_format"))
    so = body.structured_outputs
    if so is not None:
        given = [
            (so.json_, _json_spec),
            (so.regex, lambda v: GrammarSpec("regex", v)),
            (so.choice, GrammarSpec.choice),
            (so.grammar, _grammar_text_spec),
            (so.json_object or None, lambda v: GrammarSpec.json_schema(ANY_JSON_OBJECT)),
        ]
        specs = [make(value) for value, make in given if value is not None]
        if len(specs) != 1:
            raise APIError(
                400, "structured_outputs needs exactly one field", param="structured_outputs"
            )
        found.append((specs[0], "structured_outputs"))
    extensions: list[tuple[Any, Any, str]] = [
        (body.guided_json, _json_spec, "guided_json"),
        (body.guided_regex, lambda v: GrammarSpec("regex", v), "guided_regex"),
        (body.guided_choice, GrammarSpec.choice, "guided_choice"),
        (body.guided_grammar, _grammar_text_spec, "guided_grammar"),
        (body.grammar, lambda v: GrammarSpec("gbnf", v), "grammar"),
        (body.json_schema, _json_spec, "json_schema"),
    ]
    found += [(make(value), param) for value, make, param in extensions if value is not None]
    if len(found) > 1:
        raise APIError(
            400,
            f"give one structured-output constraint, not {len(found)} "
            f"({', '.join(p for _, p in found)})",
            param=found[1][1],
        )
    return found[0] if found else None


def _json_spec(value: dict[str, Any] | str) -> GrammarSpec:
    """A schema given as text is parsed by the compiler (a 400 if it is not JSON)."""
    if isinstance(value, str):
        return GrammarSpec("json_schema", value)
    return GrammarSpec.json_schema(value)


def _grammar_text_spec(text: str) -> GrammarSpec:
    """vLLM's grammar field takes GBNF (xgrammar) or Lark (llguidance, outlines)."""
    return GrammarSpec("gbnf" if "::=" in text else "lark", text)


def check_tool_choice(tools: list[Tool] | None, choice: ToolChoice | None) -> None:
    names = {t.function.name for t in tools or []}
    if len(names) != len(tools or []):
        raise APIError(400, "tool names must be unique", param="tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(
            400, f"tool_choice names an unknown tool {choice.function.name!r}", param="tool_choice"
        )
    if choice == "required" and not names:
        raise APIError(400, 'tool_choice "required" needs tools', param="tool_choice")


def tool_grammar_spec(
    tools: list[Tool], choice: ToolChoice | None, parallel: bool, fmt: str
) -> Spec | None:
    """The grammar that enforces tool calls: for `required` and a named tool, calls only; for
    `auto` with a strict tool (hermes format), a reply that is either free text that does not
    start a call, or valid calls. None when nothing is enforced."""
    if choice == "none" or not tools:
        return None
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
    elif choice == "required" or any(t.function.strict for t in tools) and fmt == HERMES:
        chosen = tools
    else:
        return None
    # NOTE: a named tool is called once, whatever parallel_tool_calls says
    calls = _calls_rule(chosen, parallel and not isinstance(choice, NamedToolChoice), fmt)
    if choice in ("required",) or isinstance(choice, NamedToolChoice):
        lark = f"start: calls\n{calls}"
    else:
        text = r"/(?s:.+)/ & ~/(?s:\s*<tool_call>.*)/"
        lark = f"start: calls | TEXT\nTEXT: {text}\n{calls}"
    return GrammarSpec("lark", lark), "tools"


def _calls_rule(tools: list[Tool], parallel: bool, fmt: str) -> str:
    args_key = "parameters" if fmt == LLAMA3 else "arguments"
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                args_key: t.function.parameters or {"type": "object"},
            },
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    call: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if fmt == MISTRAL:
        array = {"type": "array", "items": call, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        return f"calls: %json{_json(array)}"
    one = f"%json{_json(call)}"
    if fmt == HERMES:
        one = f'"<tool_call>\\n" {one} "\\n</tool_call>"'
    if not parallel:
        return f"calls: call\ncall: {one}"
    if fmt == HERMES:
        # NOTE: a newline may end the reply too: with "\n" forced to open another call, a
        # small model that writes one after </tool_call> has to repeat the call until length
        return f'calls: call ("\\n" call)* "\\n"?\ncall: {one}'
    return f'calls: call ("; " call)*\ncall: {one}'


def _json(schema: dict[str, Any]) -> str:
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS})


async def compile_grammar(backend: Backend, spec: Spec) -> Grammar:
    """-> the engine's Grammar, or APIError 400 naming the parameter. Off the event loop: a
    large schema takes a while."""
    grammar_spec, param = spec
    if backend.grammars is None:
        raise APIError(400, "this backend has no structured-output support", param=param)
    try:
        return await asyncio.to_thread(backend.grammars.compile, grammar_spec)
    except GrammarError as e:
        raise APIError(400, f"invalid {param}: {e}", param=param) from e
