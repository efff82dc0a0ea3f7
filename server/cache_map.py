"""The live cell map: `GET /v1/cache/cells` (one snapshot) and `/v1/cache/cells/stream` (SSE).

The owner map is sent run-length encoded (`owner_runs = [value, run_length, ...]`), so the
payload grows with the number of runs, not with `n_cells`: 65,536 free cells are 2 numbers.

With several models (server/model_router.py) `?model=` picks the loaded model whose cache is
shown; the map only watches: it never loads a model nor keeps one from being unloaded.

A mixture-of-experts model's expert load rides along (`experts`: the rows each expert of each
MoE layer took so far, what /metrics exports as cellserve_moe_expert_rows), so the page shows
how evenly the router spreads the batch next to the cells it fills.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from sse_starlette.sse import EventSourceResponse

from kvcache.cells import FREE, SHARED
from scheduler.speculative import SpecStats
from scheduler.stats import CellMapSnapshot, PoolMap, SlotInfo
from server.auth import check_api_key
from server.backend import Backend
from server.deps import ROUTER_NO_MODEL, get_backend
from server.errors import APIError
from server.model_router import ModelRouter

router = APIRouter(dependencies=[Depends(check_api_key)])

# the payload of the watched cache (cell_map_payload); None once its model is unloaded (the
# stream ends)
CellSource = Callable[[], dict[str, Any] | None]


def _payload_of(backend: Backend) -> dict[str, Any]:
    load = backend.expert_load
    return cell_map_payload(backend.engine.cell_map(), None if load is None else load())


def get_cell_source(request: Request) -> CellSource:
    """The one engine's cell map, or with several models the loaded model `?model=` names
    (400 `model_required` without it, 404 for an unknown name, 400 `model_not_loaded`)."""
    models: ModelRouter | None = request.app.state.router
    if models is None:
        backend = get_backend(request)
        return lambda: _payload_of(backend)
    name = request.query_params.get("model")
    entry = models.find(None if name in (None, "", ROUTER_NO_MODEL) else name)
    if entry.backend is None or entry.status != "loaded":
        raise APIError(
            400,
            f"the model {entry.name!r} is not loaded (it is {entry.status}): the cell map shows "
            "a loaded model's cache",
            param="model",
            code="model_not_loaded",
        )

    def snapshot() -> dict[str, Any] | None:
        # NOTE: through the entry, not the Backend: a watching stream must not keep an
        # unloaded model's engine and cache alive
        backend = entry.backend
        return _payload_of(backend) if backend is not None else None

    return snapshot


CellSourceDep = Annotated[CellSource, Depends(get_cell_source)]


def encode_runs(owner_map: np.ndarray) -> list[int]:
    """[value, run_length, value, run_length, ...] over the cells in index order."""
    values = np.asarray(owner_map, dtype=np.int32).ravel()
    if values.size == 0:
        return []
    starts = np.flatnonzero(np.concatenate(([True], values[1:] != values[:-1])))
    lengths = np.diff(np.append(starts, values.size))
    pairs = np.empty(2 * starts.size, dtype=np.int64)
    pairs[0::2] = values[starts]
    pairs[1::2] = lengths
    return pairs.tolist()


def decode_runs(runs: list[int]) -> np.ndarray:
    """Inverse of encode_runs (used by tests and by clients written in Python)."""
    pairs = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    return np.repeat(pairs[:, 0], pairs[:, 1]).astype(np.int32)


def _slot_row(slot: SlotInfo) -> dict[str, Any]:
    return {
        "req_id": slot.req_id,
        "index": slot.index,
        "seq_id": slot.seq_id,
        "state": slot.state,
        "num_prompt": slot.num_prompt,
        "num_computed": slot.num_computed,
        "num_generated": slot.num_generated,
        "cells_owned": slot.cells_owned,
        "cells_shared": slot.cells_shared,
        "pos_min": slot.pos_min,
        "pos_max": slot.pos_max,
    }


def _pool_row(pool: PoolMap) -> dict[str, Any]:
    owner_map = np.asarray(pool.owner_map, dtype=np.int32)
    used = np.count_nonzero(owner_map != FREE)
    return {
        "name": pool.name,
        "kind": pool.kind,  # "cells": K/V per token; "slots": one recurrent state each
        "window": int(pool.window),
        "n_cells": int(pool.n_cells),
        "head": int(pool.head),
        "owner_runs": encode_runs(owner_map),
        "used": int(used),
        "shared": int(np.count_nonzero(owner_map == SHARED)),
        "free": int(np.count_nonzero(owner_map == FREE)),
        "bytes_per_cell": int(pool.bytes_per_cell),  # slots: one state's bytes (0: unknown)
        "bytes_used": int(used * pool.bytes_per_cell),
    }


def cell_map_payload(
    snap: CellMapSnapshot, expert_rows: list[list[int]] | None = None
) -> dict[str, Any]:
    """The JSON body of /v1/cache/cells: every number the page shows, from one snapshot.
    The top-level map and totals are the full-attention pool's; `pools` lists every pool
    (with a sliding-window model's iSWA memory: "full", then "swa"; a recurrent or hybrid
    model's state slots come last, as pool "recurrent" of kind "slots"). `experts`: None for a
    dense model, else per MoE layer (in order) the rows each expert took, cumulative."""
    owner_map = np.asarray(snap.owner_map, dtype=np.int32)
    stats = snap.stats
    holders = sorted(int(s) for s in snap.holder_seq_ids)
    num_free = int(np.count_nonzero(owner_map == FREE))
    return {
        "n_cells": int(snap.n_cells),
        "head": int(snap.head),
        "owner_runs": encode_runs(owner_map),
        "slots": [_slot_row(s) for s in snap.slots],
        "holder_seq_ids": holders,
        "totals": {
            "used": int(stats.cells_used),
            "shared": int(stats.cells_shared),
            "cached": int(stats.cells_cached),
            "free": num_free,
        },
        "prefix_cache": {
            "hit_tokens": int(stats.prefix_cache_hit_tokens),
            "queried_tokens": int(stats.prefix_cache_queried_tokens),
        },
        "num_context_shifts": int(stats.num_context_shifts),
        "num_preemptions": int(stats.num_preemptions),
        "num_waiting": int(stats.num_waiting),
        "num_running": int(stats.num_running),
        "num_steps": int(stats.num_steps),
        "pools": [_pool_row(p) for p in snap.pools],
        "speculative": None if stats.spec is None else _spec_row(stats.spec),
        "experts": {"rows": expert_rows} if expert_rows else None,
    }


def _spec_row(spec: SpecStats) -> dict[str, Any]:
    """Speculative decoding's counters (scheduler/speculative.py), cumulative."""
    return {
        "num_drafts": spec.num_drafts,
        "num_draft_tokens": spec.num_draft_tokens,
        "num_accepted_tokens": spec.num_accepted_tokens,
        "num_emitted_tokens": spec.num_emitted_tokens,
        "acceptance_lengths": list(spec.acceptance_lengths),
    }


@router.get("/v1/cache/cells")
async def get_cells(source: CellSourceDep) -> dict[str, Any]:
    payload = source()
    if payload is None:
        raise APIError(400, "the model was unloaded", param="model", code="model_not_loaded")
    return payload


async def _cell_events(
    request: Request, source: CellSource, interval: float
) -> AsyncIterator[dict[str, str]]:
    """One event per tick while the client is connected and the model loaded; unchanged
    snapshots are skipped (sse-starlette's pings keep an idle connection alive)."""
    last = ""
    while not await request.is_disconnected():
        payload = source()
        if payload is None:
            return
        data = json.dumps(payload, separators=(",", ":"))
        if data != last:
            last = data
            yield {"event": "cells", "data": data}
        await asyncio.sleep(interval)


@router.get("/v1/cache/cells/stream")
async def stream_cells(
    request: Request, source: CellSourceDep, interval_ms: int = Query(250, ge=50, le=5000)
) -> EventSourceResponse:
    return EventSourceResponse(_cell_events(request, source, interval_ms / 1000), ping=5)
