"""The LoRA adapters a server runs (`--lora`, `--lora-scaled`) as the API sees them.

llama.cpp's habits: adapters have ids 0..n-1 in the order given; each has a global scale
(`--lora-scaled`, default 1, 0 with `--lora-init-without-apply`) that `GET /lora-adapters`
lists and `POST /lora-adapters` sets; a request without a `lora` field runs with the global
scales, one with `lora: [{"id", "scale"}]` with exactly those (the others at 0). vLLM's habit:
an adapter is also a model, named by its own name or "<base>:<name>", listed by /v1/models with
`parent` = the base; a request for it runs that adapter alone at scale 1.
A selection becomes the engine's scheduler.plan.LoraKey. Adapters loaded at runtime
(server/lora_runtime.py) take the next id; an id is never reused after an unload.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from scheduler.plan import LoraKey
from server.errors import APIError


@dataclass(slots=True)
class ServedAdapter:
    id: int
    name: str
    path: str
    scale: float  # the global scale (POST /lora-adapters)
    rank: int = 0
    alpha: float = 0.0


class LoraAdapters:
    """Thread-safe: the global scales change under POST while requests read them."""

    def __init__(self, base_name: str, adapters: list[ServedAdapter]) -> None:
        self.base_name = base_name
        self.adapters = adapters
        # NOTE: ids only grow (runtime loads): K/V cached under an unloaded adapter's id is
        # never another adapter's (the prefix cache keys holders by LoraKey)
        self.next_id = len(adapters)
        # ids below: the start-up adapters, part of the model fingerprint (slot files, the disk
        # tier); a runtime adapter's id may be another adapter's after a restart
        self.num_fixed = len(adapters)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.adapters)

    def names(self) -> dict[int, str]:
        return {a.id: a.name for a in self.adapters}

    def by_id(self, aid: int) -> ServedAdapter | None:
        return next((a for a in self.adapters if a.id == aid), None)

    def add(self, name: str, path: str, scale: float, rank: int, alpha: float) -> ServedAdapter:
        """Serve a new adapter under the next id."""
        with self._lock:
            adapter = ServedAdapter(self.next_id, name, path, scale, rank, alpha)
            self.next_id += 1
            self.adapters = [*self.adapters, adapter]
        return adapter

    def replace(self, old: ServedAdapter, path: str, rank: int, alpha: float) -> ServedAdapter:
        """Serve new weights under `old`'s name, place and global scale, with the next id."""
        with self._lock:
            adapter = ServedAdapter(self.next_id, old.name, path, old.scale, rank, alpha)
            self.next_id += 1
            self.adapters = [adapter if a is old else a for a in self.adapters]
        return adapter

    def remove(self, name: str) -> ServedAdapter | None:
        """Stop serving the adapter named `name` (its own name only); None if none is."""
        with self._lock:
            adapter = next((a for a in self.adapters if a.name == name), None)
            self.adapters = [a for a in self.adapters if a is not adapter]
        return adapter

    def find(self, model: str | None) -> ServedAdapter | None:
        """The adapter a model name picks: its own name or "<base>:<name>"."""
        if not model:
            return None
        prefix = self.base_name + ":"
        name = model[len(prefix) :] if model.startswith(prefix) else model
        return next((a for a in self.adapters if a.name == name), None)

    def listing(self) -> list[dict[str, Any]]:
        """GET /lora-adapters (llama.cpp's fields, plus the name)."""
        with self._lock:
            return [
                {"id": a.id, "path": a.path, "scale": a.scale, "name": a.name}
                for a in self.adapters
            ]

    def parse(self, entries: Any, param: str = "lora") -> LoraKey:
        """llama.cpp's `[{"id": N, "scale": S}]` -> a LoraKey (ids not listed: scale 0);
        APIError 400 for anything else."""
        if not isinstance(entries, list):
            raise APIError(400, f"{param} must be a list of {{id, scale}} objects", param=param)
        scales: dict[int, float] = {}
        for i, e in enumerate(entries):
            if not isinstance(e, dict) or not isinstance(e.get("id"), int):
                msg = f"{param}[{i}] must be an object with an integer id"
                raise APIError(400, msg, param=param)
            aid, scale = e["id"], e.get("scale", 0.0)
            if self.by_id(aid) is None:
                raise APIError(
                    400,
                    f"{param}[{i}]: no LoRA adapter with id {aid} "
                    f"(this server has {len(self.adapters)}: GET /lora-adapters)",
                    param=param,
                    code="lora_not_found",
                )
            if isinstance(scale, bool) or not isinstance(scale, int | float):
                raise APIError(400, f"{param}[{i}].scale must be a number", param=param)
            if not -100.0 <= scale <= 100.0:
                raise APIError(400, f"{param}[{i}].scale must be in [-100, 100]", param=param)
            scales[aid] = float(scale)
        return tuple(sorted((a, s) for a, s in scales.items() if s != 0.0))

    def set_scales(self, entries: Any) -> None:
        """POST /lora-adapters: the listed scales, every other adapter at 0 (llama.cpp)."""
        key = dict(self.parse(entries, param="body"))
        with self._lock:
            for a in self.adapters:
                a.scale = key.get(a.id, 0.0)

    def global_key(self) -> LoraKey:
        with self._lock:
            return tuple((a.id, a.scale) for a in self.adapters if a.scale != 0.0)

    def select(self, model: str | None, lora: Any | None) -> LoraKey:
        """A request's adapters: its `lora` list, else the adapter its model names, else the
        global scales."""
        if lora is not None:
            return self.parse(lora)
        adapter = self.find(model)
        if adapter is not None:
            return ((adapter.id, 1.0),)
        return self.global_key()

    def name_of(self, key: LoraKey) -> str | None:
        """KV events' lora_name: the adapter's name for one adapter at scale 1, else the
        selection spelled out; None for the base model."""
        if not key:
            return None
        names = self.names()
        if len(key) == 1 and key[0][1] == 1.0:
            return names.get(key[0][0], str(key[0][0]))
        return "+".join(f"{names.get(a, str(a))}*{s:g}" for a, s in key)


def reply_model(backend: Any, model: str | None) -> str:
    """The `model` of a reply: the adapter's name when the request named one (vLLM's), else
    the served model's."""
    adapters: LoraAdapters | None = getattr(backend, "loras", None)
    adapter = None if adapters is None else adapters.find(model)
    return backend.model_name if adapter is None else adapter.name


def select_lora(backend: Any, model: str | None, lora: Any | None) -> LoraKey:
    """The request's LoraKey on `backend`; 400 for a `lora` field on a server without any."""
    adapters: LoraAdapters | None = getattr(backend, "loras", None)
    if adapters is None or not len(adapters):
        if lora:
            raise APIError(400, "this server has no LoRA adapters (--lora)", param="lora")
        return ()
    return adapters.select(model, lora)
