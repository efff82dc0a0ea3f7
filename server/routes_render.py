"""POST /v1/completions/render and POST /v1/chat/completions/render: vLLM's render endpoints.

The engine request a completion would run, without running it: the prompt's token ids (chat
template applied) and the sampling parameters, in vLLM's GenerateRequest shape
(vllm/entrypoints/serve/disagg/protocol.py). The ids are the ones generation submits (the same
prepare_chat / completion_requests path), which is what llm-d's precise prefix-cache scorer
and vllm-router hash to find the replica that holds a prompt's prefix.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel

from scheduler.request import Request as EngineRequest
from server.auth import check_api_key
from server.backend import Backend
from server.chat_run import prepare_chat
from server.deps import BackendDep, SettingsDep
from server.routes_completions import completion_requests
from server.schemas import ChatCompletionRequest, CompletionRequest, SamplingBody

router = APIRouter(dependencies=[Depends(check_api_key)], tags=["render"])


class GenerateRequest(BaseModel):
    """vLLM's GenerateRequest (tokens in): what /inference/v1/generate would take."""

    request_id: str
    token_ids: list[int]
    features: str | None = None  # multimodal inputs: cellserve reads text only
    sampling_params: dict[str, Any]
    model: str
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None


def sampling_params(req: EngineRequest, body: SamplingBody) -> dict[str, Any]:
    """vLLM's SamplingParams fields for what the engine request asks. `stop_token_ids`
    includes the model's EOS ids (cellserve stops on them unless ignore_eos); a grammar
    (structured outputs) is not carried."""
    s = req.sampling
    return {
        "n": req.n,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "seed": s.seed,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty,
        "logit_bias": {str(k): v for k, v in s.logit_bias.items()} or None,
        "stop": body.stop_list,
        "stop_token_ids": sorted(req.stop_token_ids),
        "ignore_eos": req.ignore_eos,
        "max_tokens": req.max_tokens,
        "min_tokens": req.min_tokens,
        "logprobs": s.top_logprobs if s.logprobs else None,
        "skip_special_tokens": True,
    }


def _render(req: EngineRequest, body: SamplingBody, backend: Backend) -> GenerateRequest:
    return GenerateRequest(
        request_id=req.req_id,
        token_ids=list(req.prompt_ids),
        sampling_params=sampling_params(req, body),
        model=backend.model_name,
        stream=bool(body.stream),
        stream_options=body.stream_options.model_dump() if body.stream_options else None,
    )


@router.post("/v1/completions/render")
async def render_completion(
    body: CompletionRequest, backend: BackendDep, settings: SettingsDep
) -> list[GenerateRequest]:
    """One GenerateRequest per prompt of the batch."""
    requests, _ = await completion_requests(body, f"cmpl-{uuid.uuid4().hex}", backend, settings)
    return [_render(r, body, backend) for r in requests]


@router.post("/v1/chat/completions/render")
async def render_chat(
    body: ChatCompletionRequest, backend: BackendDep, settings: SettingsDep
) -> GenerateRequest:
    req, _ = await prepare_chat(body, f"chatcmpl-{uuid.uuid4().hex}", backend, settings)
    return _render(req, body, backend)
