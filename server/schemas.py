"""Request bodies of the OpenAI API (plus vLLM / llama.cpp extensions), validated by pydantic.

Response bodies are in server/schemas_out.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from server.schemas_tools import ResponseFormat, StructuredOutputs, Tool, ToolCallIn, ToolChoice


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingBody(_Body):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM: -1 or 0 = off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # NOTE: at least 0.01: dividing a logit by less overflows float32 (inf, then NaN probs)
    repetition_penalty: float | None = Field(None, ge=0.01, le=10.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    n_keep: int | None = Field(None, ge=0)
    context_shift: bool | None = None
    # structured outputs (server/structured.py): OpenAI's, then vLLM's and llama.cpp's names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    grammar: str | None = None  # llama.cpp: GBNF
    json_schema: dict[str, Any] | None = None  # llama.cpp
    # speculative decoding (scheduler/speculative.py): false opts this request out; llama.cpp's
    # n_draft and "speculative.n_max" cap its drafted tokens per step (0: none)
    speculative: bool | None = None
    # vLLM: logprobs name their tokens "token_id:<id>" (tokens that are not whole UTF-8 text
    # alone, or that share a text, stay apart)
    return_tokens_as_token_ids: bool = False
    n_draft: int | None = Field(None, ge=0, le=256)
    speculative_n_max: int | None = Field(None, ge=0, le=256, alias="speculative.n_max")
    # llama.cpp: LoRA adapters by id with their scales, [{"id": 0, "scale": 0.5}] (server/lora.py)
    lora: list[Any] | None = None

    @property
    def draft_max(self) -> int | None:
        """The request's cap on drafted tokens; None: the server's --draft-max."""
        if self.speculative is False:
            return 0
        return self.speculative_n_max if self.speculative_n_max is not None else self.n_draft

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"logit_bias key {key!r} is not a token id")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias value {bias} is outside [-100, 100]")
        return v

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(BaseModel):
    """A part of a message's content. Only text is read; other types (image_url, input_audio,
    file) are kept so that the route can refuse them by name."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingBody):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # see server/unsupported.py

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the reply continues the final assistant turn
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # accepted; passed to the template as `reasoning_effort` (SmolLM2's ignores it)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingBody):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # see server/unsupported.py

    prompt: Prompt
    suffix: str | None = None  # fill-in-the-middle: the text after the insertion (server/fim.py)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    add_special_tokens: bool = True


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    content: str | None = None  # llama.cpp's name for the prompt
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_special: bool | None = None  # llama.cpp's name for add_special_tokens
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None  # with messages: rendered as /v1/chat/completions does
    chat_template_kwargs: dict[str, Any] | None = None
    with_pieces: bool = False  # llama.cpp: tokens as {"id", "piece"}


class ApplyTemplateRequest(_Body):
    """llama.cpp's POST /apply-template: the chat prompt as text, not run."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def dump_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template sees them: role + flattened text content (+ name,
    tool_calls, tool_call_id)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        item: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            item["name"] = m.name
        if m.tool_calls:
            item["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out
