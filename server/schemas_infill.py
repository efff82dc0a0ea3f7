"""Request and response bodies of llama.cpp's POST /infill (its /completion shapes)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from server.schemas import SamplingBody


class ExtraChunkIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str
    filename: str = "tmp"


class InfillRequest(SamplingBody):
    """llama.cpp's fields; `n_predict` (or `max_tokens`) bounds the middle. `id_slot`,
    `cache_prompt`, `response_fields`, `t_max_prompt_ms` and the sampler order (`samplers`)
    are accepted: the prefix cache and cellserve's sampler serve every request."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunkIn] = Field(default_factory=list)
    prompt: str = ""
    n_predict: int | None = Field(None, ge=-1)  # -1: until EOS or the context's end
    n_indent: int = Field(0, ge=0)  # stop at a line indented less than this (after the first)
    t_max_predict_ms: int = Field(0, ge=0)  # past this, stop at the next newline; 0: off


StopType = Literal["none", "eos", "limit", "word"]


class InfillChunk(BaseModel):
    """A streamed piece (`stop: false`), or the last one / the whole answer (`stop: true`)."""

    index: int = 0
    content: str
    tokens: list[int] = Field(default_factory=list)
    stop: bool
    id_slot: int = -1
    model: str | None = None
    tokens_predicted: int | None = None
    tokens_evaluated: int | None = None
    tokens_cached: int | None = None
    stop_type: StopType | None = None
    stopping_word: str | None = None
    has_new_line: bool | None = None
    truncated: bool | None = None
