"""Snapshots the engine exposes to the server (metrics, /slots, the cell map)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    num_waiting: int
    num_running: int
    n_cells: int
    cells_used: int
    cells_shared: int
    cells_cached: int  # cells owned only by prefix-cache holders
    prefix_cache_queried_tokens: int  # cumulative
    prefix_cache_hit_tokens: int  # cumulative
    num_context_shifts: int  # cumulative
    num_preemptions: int  # cumulative
    num_prompt_tokens: int  # cumulative prompt tokens computed by the model
    num_generated_tokens: int  # cumulative
    num_steps: int
    alive: bool
    draining: bool

    @property
    def cache_usage(self) -> float:
        return self.cells_used / self.n_cells if self.n_cells else 0.0


@dataclass(slots=True)
class StepStats:
    """Handed to the engine's on_step callback after every step (engine thread)."""

    num_tokens: int
    num_decode: int
    num_prefill: int
    step_time: float  # seconds, whole step
    schedule_time: float  # seconds spent in schedule() + update()


@dataclass(slots=True)
class SlotInfo:
    req_id: str
    index: int  # choice index
    seq_id: int  # -1 while waiting
    state: str  # "waiting" | "prefill" | "decode"
    num_prompt: int
    num_computed: int
    num_generated: int
    cells_owned: int
    cells_shared: int
    pos_min: int
    pos_max: int


@dataclass(slots=True)
class CellMapSnapshot:
    """One consistent picture of the cache for the web page's cell map."""

    n_cells: int
    head: int
    owner_map: object  # np.ndarray[int32] [n_cells]: kvcache.cells FREE, SHARED, or the owner
    slots: list[SlotInfo]
    holder_seq_ids: list[int]  # seq ids that are prefix-cache holders
    stats: EngineStats
