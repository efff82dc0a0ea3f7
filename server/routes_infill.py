"""POST /infill: llama.cpp's fill-in-the-middle (input_prefix, input_suffix, input_extra,
prompt), answered in llama.cpp's /completion shapes, JSON or a stream of `data:` chunks
(without OpenAI's [DONE]). The prompt is server/fim.py's; sampling is the completions'. As
llama.cpp, the body is JSON whatever its content-type."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

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
from server.fim import ExtraChunk, fim_tokens, fim_window, infill_ids
from server.generation import ChoiceDelta, Generation
from server.line_limits import LineLimits
from server.prompts import make_request
from server.schemas_infill import InfillChunk, InfillRequest, StopType
from server.structured import body_grammar_spec, compile_grammar
from server.unsupported import COMPLETION_RULES, reject_unsupported


class JSONBodyRoute(APIRoute):
    """Reads the body as JSON whatever its content-type says, as llama.cpp's server does
    (`curl -d` sends application/x-www-form-urlencoded; some editor plugins send none)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def as_json(request: Request) -> Response:
            headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
            request.scope["headers"] = [*headers, (b"content-type", b"application/json")]
            return await handler(Request(request.scope, request.receive))

        return as_json


router = APIRouter(
    dependencies=[Depends(check_api_key)], tags=["llama.cpp"], route_class=JSONBodyRoute
)


@router.post("/infill")
async def infill(
    body: InfillRequest,
    request: Request,
    backend: BackendDep,
    settings: SettingsDep,
    metrics: MetricsDep,
) -> Any:
    check_model(body.model, backend)
    check_generative(backend)
    reject_unsupported(body, COMPLETION_RULES)
    if body.n != 1:
        raise APIError(400, "n: /infill answers one middle", param="n")
    fim = fim_tokens(backend.tokenizer, backend.model_name, "input_prefix")
    max_tokens = body.max_tokens if body.n_predict in (None, -1) else body.n_predict
    if max_tokens == 0:
        raise APIError(400, "n_predict must be at least 1 (or -1)", param="n_predict")
    extra = [ExtraChunk(c.filename, c.text) for c in body.input_extra]
    window = fim_window(backend.n_ctx_seq, max_tokens)
    ids = await run_in_threadpool(
        infill_ids,
        backend.tokenizer,
        fim,
        body.input_prefix,
        body.input_suffix,
        extra,
        body.prompt,
        window,
    )
    spec = body_grammar_spec(body)
    grammar = await compile_grammar(backend, spec) if spec is not None else None
    engine_request = make_request(
        f"infill-{uuid.uuid4().hex}",
        ids,
        body,
        backend=backend,
        settings=settings,
        max_tokens=max_tokens,
        default_max_tokens=None,  # the context's room
        n_keep=0,
        logprobs=False,
        top_logprobs=0,
        prompt_param="input_prefix",
        grammar=grammar,
    )
    engine_request.stop_token_ids |= fim.stop_ids
    log_request(settings, engine_request.req_id, body.input_prefix, len(ids), stream=body.stream)
    gen = Generation(
        backend,
        metrics,
        [engine_request],
        body.stop_list,
        settings.request_timeout,
        False,
        max_buffered=settings.stream_buffer,
        prompt_param="input_prefix",
    )
    gen.submit()
    limits = LineLimits(body.n_indent, body.t_max_predict_ms)
    if body.stream:
        return sse_response(gen, lambda g: _chunks(g, limits, len(ids)), done=False)
    [r] = await collect(gen, request, [""], limited(gen, limits))
    return _last(backend, gen, r.text, r, len(ids), "\n" in r.text)


async def limited(gen: Generation, limits: LineLimits) -> AsyncIterator[ChoiceDelta]:
    """gen.deltas() cut by n_indent / t_max_predict_ms: llama.cpp's stop_type "limit", a
    normal end of the middle, counted as finish_reason "length" (llama.cpp's OpenAI answers map
    a limit to "length"), not as an abort; the engine drops the rest, and the deltas run on to
    its finish event, as after a stop string."""
    async with contextlib.aclosing(gen.deltas()) as deltas:
        async for d in deltas:
            if limits.active and d.text:
                d.text, stop = limits.feed(d.text)
                if stop:
                    gen.stop(d.index, "length")  # NOTE: the choice yields nothing after this
                    yield ChoiceDelta(d.index, d.text, d.logprobs, "limit")
                    continue
            yield d


def _stop_type(finish: ChoiceDelta) -> StopType:
    if finish.finish_reason == "stop":
        return "word" if finish.stop_string is not None else "eos"
    return "limit"


def _last(
    backend: Backend,
    gen: Generation,
    content: str,
    finish: ChoiceDelta,
    num_prompt: int,
    has_new_line: bool,
) -> InfillChunk:
    _, num_output, num_cached = gen.usage()
    return InfillChunk(
        content=content,
        stop=True,
        model=backend.model_name,
        tokens_predicted=num_output,
        tokens_evaluated=num_prompt,
        tokens_cached=num_cached,
        stop_type=_stop_type(finish),
        stopping_word=finish.stop_string or "",
        has_new_line=has_new_line,
        truncated=False,
    )


async def _chunks(
    gen: Generation, limits: LineLimits, num_prompt: int
) -> AsyncIterator[InfillChunk]:
    has_new_line = False
    async for d in limited(gen, limits):
        if d.text:
            has_new_line = has_new_line or "\n" in d.text
            num_tokens = gen.choices[0].num_tokens
            yield InfillChunk(
                content=d.text,
                stop=False,
                tokens_predicted=num_tokens,
                tokens_evaluated=num_prompt,
            )
        if d.finish_reason is not None:
            yield _last(gen.backend, gen, "", d, num_prompt, has_new_line)
