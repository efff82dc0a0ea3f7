"""What the SGLang and vLLM routers ask a worker when they register it.

sglang-router (the SGLang Model Gateway) reads `GET /server_info` (then `/get_server_info`)
and `GET /model_info` (then `/get_model_info`) at registration: the worker's model id comes
from `served_model_name` or `model_path`. A request the router forwards without a `model`
carries its sentinel `"unknown"` (server.deps.ROUTER_NO_MODEL), which check_model takes as
"no model given". vllm-router calls the render endpoints (server/routes_render.py) and
/tokenize.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from server.auth import check_api_key
from server.deps import BackendDep, SettingsDep

router = APIRouter(dependencies=[Depends(check_api_key)], tags=["routers"])


def _model_path(settings: SettingsDep, backend: BackendDep) -> str:
    return settings.model or backend.model_name


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(backend: BackendDep, settings: SettingsDep, request: Request) -> Any:
    """SGLang's server info, the fields a router reads: the model's names and the limits."""
    return {
        "model_path": _model_path(settings, backend),
        "served_model_name": backend.model_name,
        "tokenizer_path": _model_path(settings, backend),
        "max_total_tokens": backend.n_cells,
        "context_length": backend.n_ctx_seq,
        "max_running_requests": settings.n_seq_max,
        "max_prefill_tokens": settings.n_batch,
        "dp_size": 1,
        "version": request.app.version,
        "engine": "cellserve",
    }


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(backend: BackendDep, settings: SettingsDep) -> Any:
    """SGLang's model info: `is_generation` is true (embeddings ride on the same model)."""
    return {
        "model_path": _model_path(settings, backend),
        "tokenizer_path": _model_path(settings, backend),
        "served_model_name": backend.model_name,
        "is_generation": True,
    }
