"""Request-side schemas of structured outputs, tools and reasoning (OpenAI + vLLM / llama.cpp
extensions); the fields they fill are declared in server/schemas.py."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    # NOTE: "schema" shadows a BaseModel attribute, hence the alias
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format; llama.cpp's {"type": "json_object", "schema": {...}} too."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` (exactly one field)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # GBNF or Lark
    json_object: bool | None = None


class FunctionDef(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Body):
    """An assistant message's tool call, sent back in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn
