"""llama.cpp's slot save/restore: `POST /slots/{id_slot}?action=save|restore|erase`.

A slot is a seq id; what it holds is a finished conversation's cells, kept by the prefix cache
(scheduler/saved_slots.py). Save writes its tokens and K/V rows to `--slot-save-path` as a cell
file (kvcache/cell_file.py); restore makes the slot hold them again, so the next request whose
prompt starts with those tokens reports them as `cached_tokens`; erase forgets them. The cell
work runs on the engine thread between two steps; the file is read and written off it. File
names are plain names inside the folder (no '/', no '..', no absolute path: 400), and a file
saved from another model, damaged or truncated is refused (400), never restored.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from kvcache.cell_file import (
    CellFile,
    CellFileError,
    check_geometry,
    check_last_rows,
    copy_out,
    read_cell_file,
    write_back,
    write_cell_file,
)
from scheduler.saved_slots import SlotError, erase_slot, restore_slot, slot_cells
from server.auth import check_api_key
from server.backend import Backend
from server.deps import BackendDep, SettingsDep
from server.errors import APIError
from server.settings import Settings

router = APIRouter(dependencies=[Depends(check_api_key)], tags=["llama.cpp"])

_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")


class SlotFileRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    filename: str | None = None


def _call(backend: Backend, fn: Any) -> Any:
    call = getattr(backend.engine, "call", None)
    if call is None:
        raise APIError(501, "this engine does not support slot actions")
    try:
        return call(fn)
    except SlotError as e:
        raise APIError(e.status, str(e), param="id_slot") from e


def _path(settings: Settings, filename: str | None) -> Path:
    if settings.slot_save_path is None:
        raise APIError(501, "slot save/restore is off: start the server with --slot-save-path DIR")
    if not filename:
        raise APIError(400, "'filename' is required", param="filename")
    if not _NAME.fullmatch(filename) or filename in (".", "..") or filename.startswith("."):
        raise APIError(
            400,
            "invalid filename: a plain name of letters, digits, '.', '_' or '-' inside the "
            "slot folder (no '/', no '..', not starting with '.')",
            param="filename",
        )
    folder = Path(settings.slot_save_path).resolve()
    path = (folder / filename).resolve()
    if path.parent != folder:  # NOTE: the pattern already forbids this; never write outside
        raise APIError(400, "invalid filename", param="filename")
    return path


def _save(backend: Backend, id_slot: int, path: Path) -> dict[str, Any]:
    t0 = time.perf_counter()

    def read(sched: Any, worker: Any) -> CellFile:
        held = slot_cells(sched, id_slot)
        fixed = backend.loras.num_fixed if backend.loras is not None else 0
        if any(aid >= fixed for aid, _ in held.lora):
            raise APIError(
                400,
                "this slot was computed under a LoRA adapter loaded at runtime: a slot file "
                "names adapters by id, which only the start-up ones (--lora) keep",
                param="id_slot",
            )
        return copy_out(backend.model_fingerprint, held, worker)

    data = _call(backend, read)
    path.parent.mkdir(parents=True, exist_ok=True)
    n_written = write_cell_file(path, data)
    return {
        "id_slot": id_slot,
        "filename": path.name,
        "n_saved": int(data.tokens.shape[0]),
        "n_written": n_written,
        "timings": {"save_ms": (time.perf_counter() - t0) * 1000.0},
    }


def _restore(backend: Backend, id_slot: int, path: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    if not path.is_file():
        raise APIError(404, f"no slot file {path.name!r}", param="filename")
    try:
        data, n_read = read_cell_file(path, backend.model_fingerprint)
    except CellFileError as e:
        raise APIError(400, f"slot file {path.name!r} cannot be restored: {e}") from e

    def write(sched: Any, worker: Any) -> None:
        try:
            check_geometry(data.groups, worker.kv_geometry())  # before the slot is touched
            check_last_rows(data)
        except CellFileError as e:
            raise APIError(400, f"slot file {path.name!r} cannot be restored: {e}") from e
        cells = restore_slot(sched, id_slot, data.tokens, data.lora, data.lora_name)
        try:
            write_back(data, cells, worker)
        except Exception as e:  # hold nothing unwritten
            sched.seq_ids.drop_holder(id_slot)
            if isinstance(e, CellFileError):  # it lacks rows the cache keeps (the slot is empty)
                raise APIError(400, f"slot file {path.name!r} cannot be restored: {e}") from e
            raise

    _call(backend, write)
    return {
        "id_slot": id_slot,
        "filename": path.name,
        "n_restored": int(data.tokens.shape[0]),
        "n_read": n_read,
        "timings": {"restore_ms": (time.perf_counter() - t0) * 1000.0},
    }


@router.get("/slots/cached")
async def cached_slots(backend: BackendDep) -> list[dict[str, Any]]:
    """The finished conversations the cache holds: first those in the prefix index over cells
    (no slot: `id_slot` -1, one row per leaf, `n_tokens` its whole path), then the slots that
    hold one (what save can write); each part oldest first by its own `last_used` clock."""

    def held(sched: Any, _worker: Any) -> list[dict[str, Any]]:
        radix = sched.seq_ids.radix
        leaves = [n for n in radix.nodes() if not n.children] if radix is not None else []
        indexed = [
            {"id_slot": -1, "n_tokens": n.end, "last_used": n.last_used, "source": "index"}
            for n in leaves
        ]
        slots = [
            {
                "id_slot": sid,
                "n_tokens": int(sched.prefix.tokens(sid).shape[0]),
                "last_used": sched.prefix.last_used(sid),
                "source": "slot",
            }
            for sid in sched.prefix.seq_ids
        ]
        by_age = lambda r: r["last_used"]  # noqa: E731
        return sorted(indexed, key=by_age) + sorted(slots, key=by_age)

    return await run_in_threadpool(_call, backend, held)


@router.post("/slots/{id_slot}")
async def slot_action(
    id_slot: int,
    backend: BackendDep,
    settings: SettingsDep,
    action: str = Query(...),
    body: SlotFileRequest | None = None,
) -> dict[str, Any]:
    filename = body.filename if body is not None else None
    if action == "save":
        path = _path(settings, filename)
        return await run_in_threadpool(_save, backend, id_slot, path)
    if action == "restore":
        path = _path(settings, filename)
        return await run_in_threadpool(_restore, backend, id_slot, path)
    if action == "erase":
        n = await run_in_threadpool(_call, backend, lambda s, _w: erase_slot(s, id_slot))
        return {"id_slot": id_slot, "n_erased": n}
    raise APIError(400, f"unknown action {action!r}: save, restore or erase", param="action")
