"""A generation request as the engine sees it, and the events it streams back."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from scheduler.constraint import Grammar
from scheduler.plan import LoraKey, SamplingParams


@dataclass(slots=True)
class Request:
    req_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()  # EOS and other stop ids (server fills)
    ignore_eos: bool = False
    n: int = 1  # choices; the prompt is prefilled once and forked with seq_cp
    n_keep: int = 0  # tokens kept at the start on a context shift (server: system prompt)
    n_discard: int | None = None  # None = half of what follows n_keep
    context_shift: bool | None = None  # None = the engine's default
    # prompt only: once the prompt is computed, the request finishes with an EmbeddingEvent
    # (the last prompt token's final-norm hidden state) and generates nothing; n must be 1
    embed: bool = False
    grammar: Grammar | None = None  # structured output: every choice's tokens follow it
    # speculative decoding: tokens drafted per step at most (None: the engine's draft_max;
    # 0: never; scheduler/speculative.py)
    draft_max: int | None = None
    # LoRA adapters (scheduler.plan.LoraKey): rows run with them, and the prefix cache reuses
    # only what was computed under the same ones; lora_name names them in KV events
    lora: LoraKey = ()
    lora_name: str | None = None


@dataclass(slots=True)
class TokenEvent:
    index: int  # choice index
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class FinishEvent:
    index: int
    reason: str  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    num_output_tokens: int
    queue_time: float = 0.0  # seconds from submit to first admission
    error: str | None = None
    # the error is the request's own grammar: llguidance could not follow it with this model's
    # tokens (e.g. a byte no token spells, where its mask then let through a token it rejects):
    # a client error, not the engine's
    grammar_error: bool = False


@dataclass(slots=True)
class EmbeddingEvent:
    index: int
    vector: np.ndarray  # [dim] float32, not normalized


Event = TokenEvent | EmbeddingEvent | FinishEvent
