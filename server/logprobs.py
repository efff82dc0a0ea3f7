"""Sampled-token logprobs in OpenAI's two shapes: chat (per token, with bytes) and completions
(parallel lists with text offsets)."""

from __future__ import annotations

import math

from server.backend import Tokenizer
from server.generation import TokenLogprob
from server.schemas_out import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


def _lp(x: float) -> float:
    return max(x, -9999.0) if not math.isnan(x) else -9999.0  # JSON has no -inf


def token_text(tok: Tokenizer, token_id: int, as_id: bool = False) -> str:
    """The token's text, or vLLM's "token_id:<id>" (return_tokens_as_token_ids: tokens
    whose text is not valid UTF-8 on its own stay apart)."""
    if as_id:
        return f"token_id:{token_id}"
    return tok.token_bytes(token_id).decode("utf-8", errors="replace")


def chat_logprobs(
    tok: Tokenizer, entries: list[TokenLogprob], as_ids: bool = False
) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        raw = list(tok.token_bytes(token_id))
        text = token_text(tok, token_id, as_ids)
        return TopLogprob(token=text, logprob=_lp(logprob), bytes=raw)

    content = [
        ChatTokenLogprob(
            **top(e.token_id, e.logprob).model_dump(),
            top_logprobs=[top(t, lp) for t, lp in e.top],
        )
        for e in entries
    ]
    return ChatLogprobs(content=content)


def completion_logprobs(
    tok: Tokenizer, entries: list[TokenLogprob], text_offset: int, as_ids: bool = False
) -> CompletionLogprobs:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for e in entries:
        tokens.append(token_text(tok, e.token_id, as_ids))
        token_logprobs.append(_lp(e.logprob))
        tops.append({token_text(tok, t, as_ids): _lp(lp) for t, lp in e.top})
        offsets.append(offset)
        offset += len(token_text(tok, e.token_id))
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets
    )
