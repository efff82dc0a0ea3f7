"""POST /v1/embeddings (input: a string, a list of strings, token ids, or lists of token ids)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from scheduler.request import Request as EngineRequest
from server.auth import check_api_key
from server.backend import Backend
from server.deps import BackendDep, SettingsDep, check_model, log_request
from server.embeddings import EmbeddingJob, finish_vector
from server.errors import APIError
from server.prompts import check_token_ids, encode_text
from server.schemas_embeddings import Embedding, EmbeddingList, EmbeddingRequest, EmbeddingUsage
from server.unsupported import EMBEDDING_RULES, reject_unsupported

router = APIRouter(dependencies=[Depends(check_api_key)], tags=["openai"])

MAX_INPUTS = 2048  # OpenAI's limit per request


def _inputs(backend: Backend, body: EmbeddingRequest) -> list[tuple[list[int], str]]:
    """-> [(token ids, the body field they came from)], one per input."""
    raw = body.input
    batch: list[str | list[int]]
    if isinstance(raw, str):
        batch = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        batch = [[int(x) for x in raw]]  # type: ignore[union-attr]
    else:
        batch = list(raw)  # type: ignore[arg-type]
    if not batch:
        raise APIError(400, "input must not be empty", param="input")
    if len(batch) > MAX_INPUTS:
        raise APIError(400, f"input holds more than {MAX_INPUTS} items", param="input")
    out = []
    for i, item in enumerate(batch):
        param = "input" if len(batch) == 1 else f"input.{i}"
        if isinstance(item, str):
            if not item:
                raise APIError(400, f"{param}: an input string must not be empty", param=param)
            out.append((encode_text(backend.tokenizer, item), param))
        else:
            if not item:
                raise APIError(400, f"{param}: a token list must not be empty", param=param)
            check_token_ids(backend, item, param)
            out.append((item, param))
    return out


def _dimensions(backend: Backend, dimensions: int | None) -> int | None:
    """-> the length to cut each vector to; None: the whole vector. A 400 for a size the model
    was not trained for (vLLM refuses `dimensions` the same way, not to serve poor vectors)."""
    full = backend.embedding_dim
    if dimensions is None or dimensions == full:
        return None
    matryoshka = backend.embedding_matryoshka
    if matryoshka is None:
        raise APIError(
            400,
            f"dimensions: this model's embeddings have {full} dimensions and it declares no "
            "shortened (Matryoshka) ones (config.json's matryoshka_dimensions or is_matryoshka; "
            f"a GGUF carries neither); omit dimensions or give {full}",
            param="dimensions",
            code="unsupported_parameter",
        )
    if not matryoshka.allows(dimensions, full):
        raise APIError(
            400,
            f"dimensions: {dimensions} is not a size this model's (Matryoshka) embeddings were "
            f"trained for: {matryoshka.describe(full)}",
            param="dimensions",
            code="invalid_value",
        )
    return dimensions


@router.post("/v1/embeddings")
async def embeddings(
    body: EmbeddingRequest, request: Request, backend: BackendDep, settings: SettingsDep
) -> EmbeddingList:
    check_model(body.model, backend)
    reject_unsupported(body, EMBEDDING_RULES)
    dimensions = _dimensions(backend, body.dimensions)
    inputs = await run_in_threadpool(_inputs, backend, body)  # NOTE: off the event loop
    base_id = f"embd-{uuid.uuid4().hex}"
    requests = [
        # NOTE: never shifted: a vector of a silently shortened input would be wrong; an input
        # past the context is a 400 from the engine (PromptError) instead
        EngineRequest(f"{base_id}-{i}", ids, max_tokens=1, embed=True, context_shift=False)
        for i, (ids, _) in enumerate(inputs)
    ]
    for req in requests:
        log_request(settings, req.req_id, req.prompt_ids, len(req.prompt_ids), embed=True)
    params = [param for _, param in inputs]
    job = EmbeddingJob(
        backend.engine, requests, params, settings.request_timeout, settings.max_queue
    )
    vectors = await job.run(request)
    data = [
        Embedding(
            index=i,
            embedding=finish_vector(
                v, body.encoding_format, backend.embedding_normalize, dimensions
            ),
        )
        for i, v in enumerate(vectors)
    ]
    n = job.num_prompt_tokens
    usage = EmbeddingUsage(prompt_tokens=n, total_tokens=n)
    return EmbeddingList(data=data, model=backend.model_name, usage=usage)
