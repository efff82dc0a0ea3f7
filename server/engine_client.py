"""What the routes need from the engine: scheduler.engine.Engine honours it, and so do the
tests' fake engines (tests/server/fake_engine.py), as vLLM's EngineClient does for its routes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from scheduler.request import Event, Request
from scheduler.stats import CellMapSnapshot, EngineStats, SlotInfo


@runtime_checkable
class EngineClient(Protocol):
    def start(self) -> None:
        """Start serving (the engine thread); called once, after the model is loaded."""

    def shutdown(self, drain_timeout: float) -> None:
        """Admit nothing new, let running requests finish for up to drain_timeout, stop."""

    def submit(self, request: Request) -> AsyncIterator[Event]:
        """Queue `request` from a running event loop; its events end after the last choice's
        FinishEvent. Raises QueueFullError / EngineDrainingError / EngineDeadError, or
        ValueError (scheduler.errors.PromptError for the prompt) for a request it cannot serve."""
        ...

    def abort(self, req_id: str, index: int | None = None) -> None:
        """Abort one choice (or every choice) of a request; its cells are freed next step."""

    def stats(self) -> EngineStats: ...

    def slots(self) -> list[SlotInfo]: ...

    def cell_map(self) -> CellMapSnapshot: ...
