"""LoRA adapters loaded and unloaded while the server runs (vLLM's POST /v1/load_lora_adapter
and /v1/unload_lora_adapter, on with --allow-runtime-lora or VLLM_ALLOW_RUNTIME_LORA_UPDATING).

- A load reads and checks the adapter as a start-up one is (model/load/lora.py) on the calling
  thread, then re-attaches the model's LoraSet between two steps (Engine.call); it takes the next
  id (ids are never reused: the prefix cache keys K/V by id), global scale 0 (requests reach it
  by name or by id; the base model's replies do not change), and a failure changes nothing. A
  lora_path that does not exist is a 404, as vLLM answers it; any other bad adapter a 400.
- `load_inplace` (vLLM's) reloads a served name with new weights: a load under the next id,
  then the name moves to it (keeping its global scale) and the old id goes as an unload's does.
- An unload takes the adapter off the API at once (a new request for it: 404 by name, 400 by
  id), as vLLM's does; requests already running or waiting finish with it: its weights stay
  attached until a later load or unload finds no request using it any more. What the prefix
  cache keeps under it is freed at once: no request can hit it again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scheduler.errors import EngineDeadError, EngineDrainingError
from server.errors import APIError
from server.lora import LoraAdapters, ServedAdapter

if TYPE_CHECKING:
    from model.load.lora import LoraAdapter

log = logging.getLogger("cellserve.server")


class LoraRuntime:
    """Loads and unloads the adapters of one model; the blocking methods run off the event
    loop (asyncio.to_thread), one at a time."""

    def __init__(self, adapters: LoraAdapters, engine: Any, worker: Any, args: Any) -> None:
        """`worker`: the ModelWorker whose model carries `worker.lora` (a LoraSet); `args`:
        the base model's ModelArgs, what adapters are checked against."""
        self.adapters = adapters
        self.engine = engine
        self.worker = worker
        self.args = args
        self._lock = threading.Lock()

    def load(self, name: str, path: str, inplace: bool = False) -> ServedAdapter:
        """`inplace` (vLLM's load_inplace): a name already served gets the new weights."""
        if not name or not path:
            raise APIError(400, "both lora_name and lora_path must be given", param="lora_name")
        with self._lock:
            if name == self.adapters.base_name:
                raise APIError(400, f"{name!r} is the base model's name", param="lora_name")
            old = self.adapters.find(name)
            if old is not None and not inplace:
                msg = (
                    f"the LoRA adapter {name!r} has already been loaded "
                    "(load_inplace: true loads new weights under its name)"
                )
                raise APIError(400, msg, param="lora_name")
            adapter = self._read(name, path)
            aid = self.adapters.next_id
            self._reattach({aid: adapter})
            if old is None:
                served = self.adapters.add(name, adapter.path, 0.0, adapter.rank, adapter.alpha)
            else:
                served = self.adapters.replace(old, adapter.path, adapter.rank, adapter.alpha)
                # the old id as an unload would drop it; a failure is logged, and the weights
                # then go at a later change
                with contextlib.suppress(APIError):
                    self._reattach({})
            assert served.id == aid, (served.id, aid)
        log.info("LoRA adapter %d %r loaded: %s, rank %d", aid, name, adapter.path, adapter.rank)
        return served

    def _read(self, name: str, path: str) -> LoraAdapter:
        """The adapter at `path`, checked against the base model; 404 when there is none."""
        from model.errors import ModelLoadError
        from model.load.lora import load_lora

        if not Path(path).exists():  # vLLM's answer: 404 NotFoundError ("No adapter found")
            msg = f"cannot load LoRA adapter {name!r}: {path}: no such file or folder"
            raise APIError(404, msg, param="lora_path", code="lora_not_found")
        try:
            return load_lora(path, self.args, self.worker.model.dtype, name)
        except Exception as e:  # noqa: BLE001 - any file that cannot be read is a bad lora_path
            why = str(e) if isinstance(e, ModelLoadError) else f"{type(e).__name__}: {e}"
            msg = f"cannot load LoRA adapter {name!r}: {why}"
            raise APIError(400, msg, param="lora_path") from e

    def unload(self, name: str) -> ServedAdapter:
        if not name:
            raise APIError(400, "lora_name must be given", param="lora_name")
        with self._lock:
            served = self.adapters.remove(name)
            if served is None:
                msg = f"the LoRA adapter {name!r} cannot be found"
                raise APIError(404, msg, param="lora_name", code="lora_not_found")
            self._reattach({})
        log.info("LoRA adapter %d %r unloaded", served.id, name)
        return served

    def _reattach(self, new: dict[int, Any]) -> None:
        """Attach the served adapters, those that requests still use, and `new` (Engine.call:
        between steps); the set stays as it was when this fails."""
        from model.layers.lora import LoraSet

        served = {a.id for a in self.adapters.adapters}

        def swap(sched: Any, _: Any) -> None:
            old = self.worker.lora
            live = {aid for s in [*sched.running, *sched.waiting] for aid, _ in s.request.lora}
            keep = {aid: a for aid, a in old.by_id.items() if aid in served | live}
            if set(keep) != set(old.by_id) or new:
                old.detach()
                try:
                    lora = LoraSet(self.worker.model, keep | new)
                except BaseException:
                    old.attach()
                    raise
                self.worker.set_lora(lora)
            # NOTE: no new request selects an id that is not served: what the prefix cache keeps
            # under it is freed now (what its running requests leave, when its weights go)
            for aid in set(old.by_id) - served:
                sched.drop_adapter_cache(aid)

        try:
            self.engine.call(swap)
        except (EngineDeadError, EngineDrainingError) as e:
            raise APIError(503, f"the engine is not running: {e}") from e
        except Exception as e:  # noqa: BLE001 - device memory, most likely: say so, serve on
            log.exception("attaching the LoRA adapters failed")
            msg = f"attaching the LoRA adapters failed ({type(e).__name__}: {e}); nothing changed"
            raise APIError(500, msg) from e
