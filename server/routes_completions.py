"""POST /v1/completions (prompt: a string, a list of strings, token ids, or lists of ids)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from scheduler.request import Request as EngineRequest
from server.auth import check_api_key
from server.backend import Backend
from server.deps import (
    BackendDep,
    MetricsDep,
    SettingsDep,
    check_generative,
    check_model,
    collect,
    log_request,
    sse_response,
)
from server.errors import APIError
from server.fim import FimTokens, fim_tokens, fim_window, infill_ids
from server.generation import Generation
from server.logprobs import completion_logprobs
from server.lora import reply_model
from server.prompts import check_token_ids, encode_text, make_request
from server.schemas import CompletionRequest
from server.schemas_out import CompletionChoice, TextCompletion, Usage
from server.settings import Settings
from server.structured import body_grammar_spec, compile_grammar
from server.unsupported import COMPLETION_RULES, reject_unsupported

router = APIRouter(dependencies=[Depends(check_api_key)], tags=["openai"])


def _prompts(
    backend: Backend, body: CompletionRequest, fim: FimTokens | None
) -> list[tuple[list[int], str]]:
    """-> [(token ids, prompt text)] for each prompt of the batch; with `fim`, each text prompt
    is the prefix of a fill-in-the-middle prompt before `body.suffix`."""
    prompt = body.prompt
    batch: list[str | list[int]]
    if isinstance(prompt, str):
        batch = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        batch = [[int(p) for p in prompt]]  # type: ignore[arg-type]
    else:
        batch = list(prompt)  # type: ignore[arg-type]
    if not batch:
        raise APIError(400, "prompt must not be empty", param="prompt")
    out = []
    for i, p in enumerate(batch):
        if isinstance(p, str) and fim is not None:
            window = fim_window(backend.n_ctx_seq, body.max_tokens)
            ids = infill_ids(backend.tokenizer, fim, p, body.suffix or "", [], "", window)
            out.append((ids, p))
        elif isinstance(p, str):
            out.append((encode_text(backend.tokenizer, p, body.add_special_tokens), p))
        elif fim is not None:
            raise APIError(400, "suffix needs text prompts, not token ids", param="suffix")
        else:
            check_token_ids(backend, p, f"prompt.{i}" if len(batch) > 1 else "prompt")
            out.append((p, backend.tokenizer.decode(p) if body.echo else ""))
    return out


async def completion_requests(
    body: CompletionRequest, base_id: str, backend: Backend, settings: Settings
) -> tuple[list[EngineRequest], list[tuple[list[int], str]]]:
    """The engine requests /v1/completions submits for `body` (one per prompt), and each
    prompt's (ids, text); also what /v1/completions/render returns. APIError on bad input."""
    check_model(body.model, backend)
    check_generative(backend)
    reject_unsupported(body, COMPLETION_RULES)
    # OpenAI's suffix: fill in the middle (an empty suffix is a plain completion, as llama.cpp)
    fim = fim_tokens(backend.tokenizer, backend.model_name, "suffix") if body.suffix else None
    prompts = await run_in_threadpool(_prompts, backend, body, fim)  # NOTE: off the event loop
    spec = body_grammar_spec(body)  # structured outputs: every prompt shares the grammar
    grammar = await compile_grammar(backend, spec) if spec is not None else None
    engine_requests = [
        make_request(
            f"{base_id}-{j}" if len(prompts) > 1 else base_id,
            ids,
            body,
            backend=backend,
            settings=settings,
            max_tokens=body.max_tokens,
            default_max_tokens=min(16, settings.max_tokens_limit),
            n_keep=0,
            logprobs=body.logprobs is not None,
            top_logprobs=body.logprobs or 0,
            prompt_param="prompt",
            grammar=grammar,
        )
        for j, (ids, _) in enumerate(prompts)
    ]
    for req in engine_requests if fim is not None else []:
        req.stop_token_ids |= fim.stop_ids
    return engine_requests, prompts


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest,
    request: Request,
    backend: BackendDep,
    settings: SettingsDep,
    metrics: MetricsDep,
) -> Any:
    base_id = f"cmpl-{uuid.uuid4().hex}"
    want_logprobs = body.logprobs is not None
    engine_requests, prompts = await completion_requests(body, base_id, backend, settings)
    for req, (_, text) in zip(engine_requests, prompts, strict=True):
        log_request(settings, req.req_id, text, len(req.prompt_ids), n=body.n, stream=body.stream)
    gen = Generation(
        backend,
        metrics,
        engine_requests,
        body.stop_list,
        settings.request_timeout,
        want_logprobs,
        max_buffered=settings.stream_buffer,
    )
    gen.submit()
    created = int(time.time())
    echoes = [text if body.echo else "" for _, text in prompts for _ in range(body.n)]
    if body.stream:
        return sse_response(gen, lambda g: _chunks(g, base_id, created, body, echoes))

    results = await collect(gen, request, echoes)
    choices = [
        CompletionChoice(
            index=r.index,
            text=r.text,
            logprobs=completion_logprobs(
                backend.tokenizer,
                r.logprobs,
                len(echoes[r.index]),
                body.return_tokens_as_token_ids,
            )
            if want_logprobs
            else None,
            finish_reason=r.finish_reason,
        )
        for r in results
    ]
    return TextCompletion(
        id=base_id,
        created=created,
        model=reply_model(backend, body.model),
        choices=choices,
        usage=Usage.of(*gen.usage()),
    )


async def _chunks(
    gen: Generation, base_id: str, created: int, body: CompletionRequest, echoes: list[str]
) -> AsyncIterator[TextCompletion]:
    head: dict[str, Any] = {
        "id": base_id,
        "created": created,
        "model": reply_model(gen.backend, body.model),
    }
    if body.include_usage:
        head["usage"] = None
    tok = gen.backend.tokenizer
    want_logprobs = body.logprobs is not None
    offsets = [len(e) for e in echoes]

    def chunk(index: int, text: str, logprobs: Any = None, reason: str | None = None):
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=reason)
        return TextCompletion(**head, choices=[choice])

    for i, echo in enumerate(echoes):
        if echo:
            yield chunk(i, echo)
    async for d in gen.deltas():
        if d.text or d.logprobs:
            lp = (
                completion_logprobs(
                    tok, d.logprobs, offsets[d.index], body.return_tokens_as_token_ids
                )
                if want_logprobs
                else None
            )
            offsets[d.index] += len(d.text)
            yield chunk(d.index, d.text, lp)
        if d.finish_reason is not None:
            yield chunk(d.index, "", None, d.finish_reason)
    if body.include_usage:
        yield TextCompletion(**{**head, "usage": Usage.of(*gen.usage())}, choices=[])
