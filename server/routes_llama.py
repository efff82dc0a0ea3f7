"""llama.cpp's small endpoints that its clients probe: GET /props (the model, the context per
sequence, the chat template, the modalities) and POST /apply-template (the chat prompt as text).
/tokenize takes llama.cpp's `content` and `with_pieces` (server/routes_misc.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from scheduler.plan import SamplingParams
from server.auth import check_api_key
from server.chat_run import template_kwargs
from server.deps import BackendDep, SettingsDep, check_model
from server.prompts import render_chat
from server.schemas import ApplyTemplateRequest, ChatCompletionRequest
from server.unsupported import reject_non_text_messages

router = APIRouter(dependencies=[Depends(check_api_key)], tags=["llama.cpp"])


@router.get("/props")
async def props(backend: BackendDep, settings: SettingsDep, request: Request) -> dict[str, Any]:
    sampling = SamplingParams()  # what a request gets when it sets nothing
    template = backend.chat_template
    return {
        "default_generation_settings": {
            "n_ctx": backend.n_ctx_seq,
            "params": {
                "temperature": sampling.temperature,
                "top_k": sampling.top_k,
                "top_p": sampling.top_p,
                "min_p": sampling.min_p,
                "repeat_penalty": sampling.repetition_penalty,
                "presence_penalty": sampling.presence_penalty,
                "frequency_penalty": sampling.frequency_penalty,
            },
        },
        "total_slots": settings.n_seq_max,
        "model_alias": backend.model_name,
        "model_path": settings.model or backend.model_name,
        "modalities": {"vision": False, "audio": False},
        "chat_template": getattr(template, "source", "") if template is not None else "",
        "bos_token": getattr(template, "bos_token", ""),
        "eos_token": getattr(template, "eos_token", ""),
        "build_info": f"cellserve {request.app.version}",
        "is_sleeping": False,
    }


@router.post("/apply-template")
async def apply_template(body: ApplyTemplateRequest, backend: BackendDep) -> dict[str, str]:
    """The text /v1/chat/completions would tokenize for the same messages and tools."""
    check_model(body.model, backend)
    reject_non_text_messages(body.messages)
    chat = ChatCompletionRequest.model_validate(
        body.model_dump(exclude_none=True, exclude={"model"})
    )
    text = await run_in_threadpool(
        render_chat, backend, chat.messages, chat.add_generation_prompt, template_kwargs(chat)
    )
    return {"prompt": text}
