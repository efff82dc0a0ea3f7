"""Response bodies of /v1/chat/completions, /v1/completions, /v1/models and /tokenize, in
OpenAI's exact shapes (field order included: it is the JSON's order)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

FINGERPRINT = "cellserve-0.1"
FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _OptionalUsage(_Out):
    """A stream chunk: `usage` is in the JSON only when it was set (stream_options.include_usage:
    null in every chunk, the totals in the last one)."""

    @model_serializer(mode="wrap")
    def _omit_unset_usage(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if "usage" not in self.model_fields_set:
            data.pop("usage", None)
        return data


class PromptTokensDetails(_Out):
    cached_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, num_prompt: int, num_completion: int, num_cached: int) -> Usage:
        return cls(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
        )


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[ChatTokenLogprob]
    refusal: str | None = None


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class _Envelope(_Out):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str = FINGERPRINT


class FunctionCall(_Out):
    name: str
    arguments: str  # JSON text


class ToolCall(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(_Out):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(_Out):
    """OpenAI's streamed tool call: index, id, type and the name first, then arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class AssistantMessage(_Out):
    """`tool_calls` and the reasoning fields are in the JSON only when set."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # DeepSeek's / vLLM's name
    reasoning: str | None = None  # the newer name (vLLM, OpenRouter): the same text

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key in ("tool_calls", "reasoning_content", "reasoning"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletion(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Out):
    """Only the fields a chunk carries: {"role", "content"} first, {"content"} then, {} last."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_OptionalUsage, _Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class TextCompletion(_OptionalUsage, _Envelope):
    """The whole completion, and each of its stream chunks (same object, as OpenAI sends)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cellserve"
    max_model_len: int
    # vLLM's: a LoRA adapter's card names its base model (`parent`) and its path (`root`)
    root: str | None = None
    parent: str | None = None


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenPiece(_Out):
    id: int
    piece: str | list[int]  # llama.cpp: the text, or the bytes when they are not UTF-8


class TokenizeResponse(_Out):
    tokens: list[int] | list[TokenPiece]
    count: int
    max_model_len: int


class DetokenizeResponse(_Out):
    prompt: str
