"""llama.cpp's LoRA endpoints: GET /lora-adapters lists the adapters (id, path, scale) and
POST /lora-adapters sets their global scales (the listed ones; every other adapter goes to 0),
what requests without a `lora` field run with (server/lora.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Depends

from server.auth import check_api_key
from server.deps import BackendDep
from server.errors import APIError

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
