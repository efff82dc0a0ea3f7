"""llama.cpp's LoRA endpoints: GET /lora-adapters lists the adapters (id, path, scale) and
POST /lora-adapters sets their global scales (the listed ones; every other adapter goes to 0),
what requests without a `lora` field run with (server/lora.py). vLLM's POST
/v1/load_lora_adapter and /v1/unload_lora_adapter add and remove adapters while the server runs
(server/lora_runtime.py): 200 with a line of text, as vLLM answers, or an OpenAI error."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from server.auth import check_api_key
from server.backend import Backend
from server.deps import BackendDep
from server.errors import APIError
from server.lora_runtime import LoraRuntime

router = APIRouter(dependencies=[Depends(check_api_key)], tags=["llama.cpp"])


@router.get("/lora-adapters")
async def list_lora_adapters(backend: BackendDep) -> list[dict[str, Any]]:
    return [] if backend.loras is None else backend.loras.listing()


@router.post("/lora-adapters")
async def set_lora_adapters(backend: BackendDep, body: Any = Body(...)) -> dict[str, Any]:
    if backend.loras is None:
        if body:
            raise APIError(400, "this server has no LoRA adapters (--lora)", param="body")
        return {"success": True}
    backend.loras.set_scales(body)
    return {"success": True}


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # vLLM's: a served name gets the new weights


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""


def _runtime(backend: Backend) -> LoraRuntime:
    if backend.lora_runtime is None:
        raise APIError(
            404,
            "loading LoRA adapters at runtime is off: start the server with "
            "--allow-runtime-lora (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
            code="runtime_lora_disabled",
        )
    return backend.lora_runtime


def _names_changed(request: Request, backend: Backend) -> None:
    if backend.loras is not None:
        request.app.state.metrics.set_lora_names(backend.loras.names())


@router.post("/v1/load_lora_adapter", tags=["vLLM"])
async def load_lora_adapter(
    body: LoadLoraAdapter, backend: BackendDep, request: Request
) -> PlainTextResponse:
    runtime = _runtime(backend)
    await asyncio.to_thread(runtime.load, body.lora_name, body.lora_path, body.load_inplace)
    _names_changed(request, backend)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", tags=["vLLM"])
async def unload_lora_adapter(
    body: UnloadLoraAdapter, backend: BackendDep, request: Request
) -> PlainTextResponse:
    runtime = _runtime(backend)
    await asyncio.to_thread(runtime.unload, body.lora_name)
    _names_changed(request, backend)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
