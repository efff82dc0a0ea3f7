"""OpenAI response shapes, built as plain dicts."""

from __future__ import annotations

import math
from typing import Any

from server.backend import Tokenizer
from server.generation import TokenLogprob

FINGERPRINT = "cellserve-0.1"


def usage_dict(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


def _lp(x: float) -> float:
    return max(x, -9999.0) if not math.isnan(x) else -9999.0  # JSON has no -inf


def token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.token_bytes(token_id).decode("utf-8", errors="replace")


def chat_logprobs(tok: Tokenizer, entries: list[TokenLogprob]) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        raw = tok.token_bytes(token_id)
        return {"token": token_text(tok, token_id), "logprob": _lp(logprob), "bytes": list(raw)}

    content = []
    for e in entries:
        entry = item(e.token_id, e.logprob)
        entry["top_logprobs"] = [item(t, lp) for t, lp in e.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(
    tok: Tokenizer, entries: list[TokenLogprob], text_offset: int
) -> dict[str, Any]:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for e in entries:
        text = token_text(tok, e.token_id)
        tokens.append(text)
        token_logprobs.append(_lp(e.logprob))
        tops.append({token_text(tok, t): _lp(lp) for t, lp in e.top})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def envelope(obj_id: str, obj: str, created: int, model: str) -> dict[str, Any]:
    return {
        "id": obj_id,
        "object": obj,
        "created": created,
        "model": model,
        "system_fingerprint": FINGERPRINT,
    }
