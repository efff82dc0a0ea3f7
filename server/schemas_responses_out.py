"""The Response object of /v1/responses and its stream events, in OpenAI's shapes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Status = Literal["in_progress", "completed", "incomplete", "failed"]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class OutputText(_Out):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(_Out):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Status
    content: list[OutputText]


class FunctionCall(_Out):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Status


class ReasoningText(_Out):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_Out):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Status


OutputItem = ReasoningItem | OutputMessage | FunctionCall


class InputTokensDetails(_Out):
    cached_tokens: int


class OutputTokensDetails(_Out):
    reasoning_tokens: int = 0


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, num_input: int, num_output: int, num_cached: int) -> ResponseUsage:
        return cls(
            input_tokens=num_input,
            input_tokens_details=InputTokensDetails(cached_tokens=num_cached),
            output_tokens=num_output,
            output_tokens_details=OutputTokensDetails(),
            total_tokens=num_input + num_output,
        )


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(_Out):
    code: str
    message: str


class ResponseObject(_Out):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class _Event(_Out):
    type: str
    sequence_number: int


class ResponseEvent(_Event):
    """response.created / in_progress / completed / incomplete / failed."""

    response: ResponseObject


class OutputItemEvent(_Event):
    """response.output_item.added / done."""

    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    """response.content_part.added / done."""

    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningDeltaEvent(_Event):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningDoneEvent(_Event):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    arguments: str


class ErrorEvent(_Event):
    """`error` (OpenAI's fields, plus the `error` object that makes the SDKs raise)."""

    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None = None
    error: dict[str, Any]
