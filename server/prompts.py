"""From a validated body to token ids and an engine Request."""

from __future__ import annotations

from typing import Any

from scheduler.constraint import Grammar
from scheduler.intake import check_fits_cache, check_min_tokens
from scheduler.plan import SamplingParams
from scheduler.request import Request
from server.backend import Backend, Tokenizer
from server.errors import APIError, engine_error
from server.lora import select_lora
from server.schemas import ChatMessage, SamplingBody, dump_messages
from server.settings import Settings

KNOWN_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def encode_text(tok: Tokenizer, text: str, add_special: bool = True) -> list[int]:
    """Encode, never with two BOS tokens (a template that writes BOS itself + the tokenizer's)."""
    ids = tok.encode(text, add_special=add_special)
    bos = tok.bos_id
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids


def render_chat(
    backend: Backend,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None = None,
    continue_final: bool = False,
) -> str:
    """`template_kwargs`: `tools` (OpenAI's list, as dicts) and chat_template_kwargs, passed
    to the template as HF's apply_chat_template does. `continue_final`: the text ends right
    after the final message's content, which the reply continues (HF's and vLLM's
    continue_final_message; Anthropic's prefill)."""
    for i, m in enumerate(messages):
        if m.role not in KNOWN_ROLES:
            raise APIError(400, f"unknown role {m.role!r}", param=f"messages.{i}.role")
    if backend.chat_template is None:
        raise APIError(
            400,
            f"the model {backend.model_name!r} has no chat template; use /v1/completions, or "
            "restart the server with --chat-template (a Jinja file or string)",
            param="messages",
            code="no_chat_template",
        )
    try:
        text = backend.chat_template.render(
            dump_messages(messages),
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # the template's own raise_exception(), or a bad structure
        raise APIError(
            400, f"the chat template rejected the messages: {exc}", param="messages"
        ) from exc
    return _cut_after_final(text, messages) if continue_final else text


def _cut_after_final(text: str, messages: list[ChatMessage]) -> str:
    """HF's continue_final_message: cut the rendered text after the final message's content."""
    final = messages[-1].text().strip() if messages else ""
    where = text.rfind(final) if final else -1
    if where < 0 or messages[-1].role != "assistant":
        raise APIError(
            400,
            "continuing the final message needs a final assistant message with text that the "
            "chat template shows",
            param="messages",
        )
    return text[: where + len(final)]


def tokenize_chat(
    backend: Backend,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    continue_final: bool = False,
) -> tuple[list[int], int]:
    """-> (prompt ids, length of the leading system segment: the default n_keep)."""
    text = render_chat(backend, messages, add_generation_prompt, template_kwargs, continue_final)
    ids = encode_text(backend.tokenizer, text)
    n_system = 0
    while n_system < len(messages) and messages[n_system].role in ("system", "developer"):
        n_system += 1
    if n_system == 0:
        return ids, 0
    sys_text = render_chat(backend, messages[:n_system], False, template_kwargs)
    sys_ids = encode_text(backend.tokenizer, sys_text)
    n_keep = 0
    for a, b in zip(ids, sys_ids, strict=False):
        if a != b:
            break
        n_keep += 1
    return ids, n_keep


def check_token_ids(backend: Backend, ids: list[int], param: str) -> None:
    vocab = backend.tokenizer.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(
            400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param=param
        )


def make_request(
    req_id: str,
    prompt_ids: list[int],
    body: SamplingBody,
    *,
    backend: Backend,
    settings: Settings,
    max_tokens: int | None,
    default_max_tokens: int | None,
    n_keep: int,
    logprobs: bool,
    top_logprobs: int,
    prompt_param: str,
    grammar: Grammar | None = None,
) -> Request:
    """`default_max_tokens` None: as many as the context has room for after the prompt (chat,
    infill), at most --max-tokens-limit and at least 1."""
    if default_max_tokens is None:
        room = backend.n_ctx_seq - len(prompt_ids)
        default_max_tokens = max(1, min(settings.max_tokens_limit, room))
    if body.n > settings.max_n:
        raise APIError(400, f"n must be at most {settings.max_n}", param="n")
    limit = settings.max_tokens_limit
    if max_tokens is not None and max_tokens > limit:
        raise APIError(400, f"max_tokens must be at most {limit}", param="max_tokens")
    # NOTE: scheduler/intake.check_request is the admission check; its rules answer at submit
    # (engine_error), after the engine's 503 / 429. These two are asked here too, before the
    # body's other checks and for /render, which submits nothing: the same functions, the same
    # messages.
    try:
        check_fits_cache(len(prompt_ids), backend.n_cells, backend.n_ctx_seq)
        check_min_tokens(body.min_tokens, max_tokens or default_max_tokens)
    except ValueError as exc:
        raise engine_error(exc, prompt_param) from exc
    bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
    check_token_ids(backend, list(bias), "logit_bias")
    top_k = body.top_k or 0
    sampling = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=max(top_k, 0),
        top_p=1.0 if body.top_p is None else body.top_p,
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=bias,
        seed=body.seed,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    n_keep = n_keep if body.n_keep is None else body.n_keep
    lora = select_lora(backend, body.model, body.lora)
    return Request(
        req_id=req_id,
        prompt_ids=list(prompt_ids),
        sampling=sampling,
        max_tokens=max_tokens or default_max_tokens,
        min_tokens=body.min_tokens,
        stop_token_ids=frozenset(int(t) for t in backend.tokenizer.eos_ids),
        ignore_eos=body.ignore_eos,
        n=body.n,
        n_keep=min(n_keep, len(prompt_ids)),
        context_shift=body.context_shift,
        grammar=grammar,
        draft_max=body.draft_max,
        lora=lora,
        lora_name=backend.loras.name_of(lora) if backend.loras is not None else None,
    )
