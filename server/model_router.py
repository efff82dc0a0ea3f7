"""Many models in one process: a Backend per model name, loaded on first use, at most
`--models-max` loaded, the least recently used idle one unloaded to make room.

llama.cpp's router mode (tools/server, `--models-dir`, `--models-max`) runs a child process
per model; here each loaded model is an in-process Backend with its own engine thread, KV
cache and weights, and unloading one stops its engine and drops every reference to it (its
memory is freed: mapped weights unmapped, the cache and owned weights collected).

Statuses: unloaded -> loading -> loaded -> unloading -> unloaded. A load that fails leaves
the model unloaded with its error: requests for it get a 503 that says why, and an explicit
POST /models/load retries. A load checks the file first (server/model_check.py), then makes
room: a missing, truncated or unsupported model does not unload an idle one. What the check
cannot see (a tensor missing or of the wrong shape, no memory left) fails after the room was
made, since the room is the memory the load needs: then what it held is freed and the models
unloaded for it load again (where the room is still free), so the server ends as it was but
for the failed model's error. Loads take their room one
at a time (the lock), so that two cannot each wait for the other's room; then they load side
by side. When every loaded model is busy, the least recently used one takes no new requests
until it is idle and unloaded (its new requests wait, then load it again): no model waits for
room for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.stats import StepStats
from server.backend import Backend, BackendFactory
from server.errors import APIError
from server.model_check import check_model_path
from server.models_dir import ModelSource
from server.settings import Settings

log = logging.getLogger("cellserve.server")

_POLL_S = 0.05  # how often a load waiting for room looks for an idle model


@dataclass(slots=True)
class ModelEntry:
    source: ModelSource
    status: str = "unloaded"  # unloaded | loading | loaded | unloading
    backend: Backend | None = None
    error: str | None = None  # why the last load failed; None: it did not
    task: asyncio.Future[None] | None = None  # the load or unload under way
    num_users: int = 0  # requests holding the backend (server.deps.get_backend)
    num_waiting: int = 0  # requests waiting in ModelRouter.acquire for it
    # counts toward --models-max: from the moment a load has room until the unload is done
    holds_room: bool = False
    # chosen to make room while busy: takes no new request (they wait on `task`), so that
    # a steady stream for it cannot keep another model from loading
    evicting: bool = False
    last_used: float = 0.0  # time.monotonic() of the last request
    num_loads: int = 0
    num_unloads: int = 0
    num_load_failures: int = 0
    load_seconds: list[float] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.source.name

    def is_idle(self) -> bool:
        """Loaded and used by no request (the engine's queue included) nor about to be (a
        request woken by its load; not those that came after an eviction began)."""
        if self.status != "loaded" or self.backend is None or self.num_users:
            return False
        if self.num_waiting and not self.evicting:
            return False
        stats = self.backend.engine.stats()
        return stats.num_running + stats.num_waiting == 0


class ModelRouter:
    def __init__(
        self,
        settings: Settings,
        sources: list[ModelSource],
        factory: BackendFactory,
        on_step: Callable[[StepStats], None],
        check: Callable[[str], None] = check_model_path,
    ) -> None:
        self.settings = settings
        self.entries = {s.name: ModelEntry(s) for s in sources}
        self.factory = factory
        self.check = check  # raises for a path the factory would fail on, before room is made
        self.on_step = on_step
        self.closed = False
        self._room_lock = asyncio.Lock()

    def find(self, name: str | None) -> ModelEntry:
        """The entry a request's `model` names; 404 (OpenAI's shape) for another name; None is
        the only model, or 400 when there are several."""
        if name is None and len(self.entries) == 1:
            return next(iter(self.entries.values()))
        if name is None:
            raise APIError(
                400,
                f"this server serves several models ({', '.join(self.entries)}): name one "
                "in `model` (GET /v1/models lists them)",
                param="model",
                code="model_required",
            )
        entry = self.entries.get(name)
        if entry is None:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.entries)} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        return entry

    async def acquire(self, entry: ModelEntry, autoload: bool | None = None) -> Backend:
        """The model's Backend, loading it first if needed (the caller waits; other models'
        requests go on); the caller must `release` it. `autoload` (llama.cpp's `?autoload=`)
        overrides --[no-]models-autoload for this request. 503 for a model that failed to load
        or no room before the request timeout."""
        if autoload is None:
            autoload = self.settings.models_autoload
        deadline = time.monotonic() + self.settings.request_timeout
        while True:
            if self.closed:
                raise APIError(503, "the server is shutting down", code="draining")
            if entry.status == "loaded" and entry.backend is not None and not entry.evicting:
                entry.num_users += 1
                entry.last_used = time.monotonic()
                return entry.backend
            if entry.status == "unloaded":
                # NOTE: the failure first: without autoload too, the client learns why (a retry
                # is an explicit POST /models/load either way)
                if entry.error is not None:
                    raise APIError(
                        503,
                        f"the model {entry.name!r} failed to load: {entry.error} "
                        "(POST /models/load tries again)",
                        code="model_load_failed",
                    )
                if not autoload:
                    raise APIError(
                        400,
                        f"the model {entry.name!r} is not loaded: load it with POST /models/load "
                        "(or ask with ?autoload=true)",
                        param="model",
                        code="model_not_loaded",
                    )
                self.start_load(entry)
            left = deadline - time.monotonic()
            if left <= 0 or entry.task is None:
                raise APIError(
                    503,
                    f"the model {entry.name!r} is not loaded: the {self.settings.models_max} "
                    "loaded models stayed busy (--models-max)",
                    code="model_not_ready",
                    headers={"Retry-After": "1"},
                )
            entry.num_waiting += 1
            try:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(entry.task), left)
            finally:
                entry.num_waiting -= 1

    def release(self, entry: ModelEntry) -> None:
        entry.num_users -= 1
        entry.last_used = time.monotonic()

    def start_load(self, entry: ModelEntry) -> None:
        """unloaded -> loading; the load runs in the background (POST /models/load returns)."""
        assert entry.status == "unloaded", entry.status
        entry.status, entry.error = "loading", None
        entry.task = asyncio.create_task(self._load(entry), name=f"load {entry.name}")

    async def _load(self, entry: ModelEntry) -> None:
        try:
            await asyncio.to_thread(self.check, entry.source.path)
        except Exception as exc:
            self._failed(entry, exc)
            return
        victims: list[ModelEntry] = []  # unloaded to make room for it
        async with self._room_lock:
            try:
                await self._make_room(entry, victims)
            except TimeoutError:
                log.warning("model %s: no room to load it (--models-max)", entry.name)
                entry.status = "unloaded"
            else:
                entry.holds_room = True
        if entry.holds_room:
            await self._load_backend(entry)
            if entry.error is None:
                return
        if victims:
            await asyncio.to_thread(_collect)  # what the failed load held, before reloading
            await self._restore(victims)

    async def _load_backend(self, entry: ModelEntry) -> None:
        """loading -> loaded, or unloaded with its error; `entry` holds room."""
        started = time.monotonic()
        log.info("loading the model %s from %s", entry.name, entry.source.path)
        try:
            backend = await asyncio.to_thread(
                self.factory, self.model_settings(entry), self.on_step
            )
            backend.engine.start()
        except Exception as exc:
            entry.holds_room = False
            self._failed(entry, exc)
            return
        entry.backend, entry.status = backend, "loaded"
        entry.last_used = time.monotonic()
        entry.num_loads += 1
        entry.load_seconds.append(time.monotonic() - started)
        log.info("model %s loaded in %.1f s", entry.name, entry.load_seconds[-1])
        if self.closed:  # the server began to drain while the model loaded
            await self.unload(entry)

    async def _restore(self, victims: list[ModelEntry]) -> None:
        """Load again, in the background, the models unloaded to make room for a load that
        then failed, while the room is free: none takes another model's place."""
        async with self._room_lock:
            for victim in victims:
                room = sum(e.holds_room for e in self.entries.values()) < self.settings.models_max
                if self.closed or not room:
                    return
                if victim.status != "unloaded" or victim.holds_room:
                    continue  # a request for it is loading it already
                log.info("model %s: loading it again (its room was for a failed load)", victim.name)
                victim.status, victim.error, victim.holds_room = "loading", None, True
                name = f"reload {victim.name}"
                victim.task = asyncio.create_task(self._load_backend(victim), name=name)

    def model_settings(self, entry: ModelEntry) -> Settings:
        """What the model loads with: the server's settings, as if it served this model alone."""
        update = {"model": entry.source.path, "served_model_name": entry.name}
        return self.settings.model_copy(update=update | {"models_dir": None, "models": []})

    def _failed(self, entry: ModelEntry, exc: Exception) -> None:
        entry.status, entry.error = "unloaded", f"{type(exc).__name__}: {exc}"
        entry.num_load_failures += 1
        log.error("cannot load the model %s: %s", entry.name, entry.error)

    async def _make_room(self, entry: ModelEntry, victims: list[ModelEntry]) -> None:
        """Unload least recently used idle models (appended to `victims`) until `entry` fits
        under --models-max; TimeoutError when the others stayed busy for the request timeout."""
        deadline = time.monotonic() + self.settings.request_timeout
        marked: ModelEntry | None = None
        try:
            while sum(e.holds_room for e in self.entries.values()) >= self.settings.models_max:
                others = [e for e in self.entries.values() if e is not entry]
                idle = [e for e in others if e.is_idle()]
                if idle:
                    victim = min(idle, key=lambda e: (not e.evicting, e.last_used))
                    log.info("unloading the model %s to make room for %s", victim.name, entry.name)
                    await self.unload(victim)
                    victims.append(victim)
                    continue
                # NOTE: only a model that serves requests: one whose waiters are about to be
                # served would be unloaded under them
                busy = [e for e in others if e.status == "loaded" and e.num_users]
                if marked is None and busy and not any(e.evicting for e in busy):
                    marked = min(busy, key=lambda e: e.last_used)
                    marked.evicting = True
                    marked.task = asyncio.get_running_loop().create_future()
                    log.info("model %s: finishing its requests to make room", marked.name)
                if self.closed or time.monotonic() > deadline:
                    raise TimeoutError
                await asyncio.sleep(_POLL_S)
        finally:
            if marked is not None and marked.evicting:  # room came otherwise, or never
                _end_eviction(marked)

    def check_unload(self, entry: ModelEntry) -> None:
        """400 for a model not loaded, 409 for one that requests are using."""
        if entry.status != "loaded":
            raise APIError(
                400,
                f"the model {entry.name!r} is not loaded (it is {entry.status})",
                param="model",
                code="model_not_loaded",
            )
        if not entry.is_idle():
            raise APIError(
                409,
                f"the model {entry.name!r} is busy: requests are using it; unload it once "
                "they finish",
                param="model",
                code="model_busy",
            )

    async def unload(self, entry: ModelEntry, drain_timeout: float = 0.0) -> None:
        """loaded -> unloading -> unloaded: stop the engine (requests still in it get up to
        `drain_timeout` seconds), then drop the Backend and collect it."""
        backend, entry.backend = entry.backend, None
        if backend is None:
            return
        entry.status = "unloading"
        if not entry.evicting or entry.task is None or entry.task.done():
            entry.task = asyncio.get_running_loop().create_future()
        # else: the eviction's future, which its waiting requests hold
        try:
            engine = backend.engine
            del backend
            await asyncio.to_thread(engine.shutdown, drain_timeout)
            del engine
            await asyncio.to_thread(_collect)
        finally:
            entry.status, entry.holds_room = "unloaded", False
            entry.num_unloads += 1
            _end_eviction(entry)
            log.info("model %s unloaded", entry.name)

    async def close(self) -> None:
        """The server's drain: no new loads; running requests get --drain-timeout."""
        self.closed = True
        for entry in self.entries.values():
            if entry.status == "loading" and entry.task is not None:
                with contextlib.suppress(Exception):
                    await entry.task
        await asyncio.gather(
            *(self.unload(e, self.settings.drain_timeout) for e in self.entries.values())
        )


def _end_eviction(entry: ModelEntry) -> None:
    """The model takes requests again (or is unloaded): wake the ones that waited."""
    entry.evicting = False
    if entry.task is not None and not entry.task.done():
        entry.task.set_result(None)


def _collect() -> None:
    """Free what the dropped Backend held: Python objects now, CUDA's cached blocks, and the
    pages glibc's malloc keeps after large frees (else RSS stays at the unloaded model's)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
