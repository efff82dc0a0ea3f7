"""Sampled-token logprobs in OpenAI's two shapes: chat (per token, with bytes) and completions
(parallel lists with text offsets)."""

from __future__ import annotations

import math

from server.backend import Tokenizer
from server.generation import TokenLogprob
from server.schemas_out import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


def _lp(x: float) -> float:
    return max(x, -9999.0) if not math.isnan(x) else -9999.0  # JSON has no -inf


def token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.token_bytes(token_id).decode("utf-8", errors="replace")


def chat_logprobs(tok: Tokenizer, entries: list[TokenLogprob]) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        raw = list(tok.token_bytes(token_id))
        return TopLogprob(token=token_text(tok, token_id), logprob=_lp(logprob), bytes=raw)

    content = [
        ChatTokenLogprob(
            **top(e.token_id, e.logprob).model_dump(),
            top_logprobs=[top(t, lp) for t, lp in e.top],
        )
        for e in entries
    ]
    return ChatLogprobs(content=content)


def completion_logprobs(
    tok: Tokenizer, entries: list[TokenLogprob], text_offset: int
) -> CompletionLogprobs:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for e in entries:
        text = token_text(tok, e.token_id)
        tokens.append(text)
        token_logprobs.append(_lp(e.logprob))
        tops.append({token_text(tok, t): _lp(lp) for t, lp in e.top})
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets
    )
