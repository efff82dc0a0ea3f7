"""Snapshots the engine exposes to the server (metrics, /slots, the cell map)."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.speculative import SpecStats


@dataclass(slots=True)
class Counters:
    """The scheduler's cumulative counters (and the last step's row split)."""

    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_running_hit_tokens: int = 0  # of prefix_hit_tokens: shared from running sequences
    num_context_shifts: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # tokens fed to the model that were not sampled just before
    num_generated_tokens: int = 0
    num_steps: int = 0
    last_num_decode: int = 0
    last_num_prefill: int = 0


@dataclass(slots=True)
class PoolUsage:
    """One pool of the memory (kvcache.memory.Pool), labelled. A pool of kind "slots" holds
    recurrent states: its cells are state slots of `bytes_per_cell` bytes each."""

    name: str  # "full" | "swa" | "recurrent"
    window: int
    n_cells: int
    used: int
    shared: int
    kind: str = "cells"  # "cells" | "slots"
    bytes_per_cell: int = 0  # slots: the worker's state_bytes_per_slot (0: not known)


@dataclass(slots=True)
class EngineStats:
    """n_cells / cells_* are the full-attention pool's (the only one of the unified cache:
    it grows with every sequence's context), or the state slots' for a model without
    attention layers; `pools` has every pool."""

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
    pools: list[PoolUsage] = field(default_factory=list)
    prefix_cache_running_hit_tokens: int = 0  # cumulative; of the hits, from running sequences
    # the prefix index over held cells (scheduler/radix.py): its nodes and the cells they hold
    prefix_index_nodes: int = 0
    prefix_index_cells: int = 0
    prefix_index_window_cells: int = 0  # iSWA: the window pools' cells its windows hold
    cells_index_only: int = 0  # of cells_used: held only by the prefix index (evictable)
    spec: SpecStats | None = None  # speculative decoding's counters; None when it is off
    # LoRA adapter ids of the running / waiting requests (vllm:lora_requests_info)
    running_lora_ids: tuple[int, ...] = ()
    waiting_lora_ids: tuple[int, ...] = ()

    @property
    def cache_usage(self) -> float:
        """Used cells but those only the prefix index holds: it gives them back on demand,
        without preempting anyone (vLLM counts its unreferenced cached blocks as free too)."""
        used = self.cells_used - self.cells_index_only
        return used / self.n_cells if self.n_cells else 0.0


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
class PoolMap:
    name: str  # "full" | "swa" | "recurrent"
    window: int
    n_cells: int
    head: int
    owner_map: object  # np.ndarray[int32] [n_cells]: -1 free, -2 shared, else owner seq id
    kind: str = "cells"  # "cells" | "slots" (PoolUsage)
    bytes_per_cell: int = 0


@dataclass(slots=True)
class CellMapSnapshot:
    """One consistent picture of the cache for the web page's cell map. n_cells, head and
    owner_map are the full-attention pool's; `pools` has every pool, that one first."""

    n_cells: int
    head: int
    owner_map: object  # np.ndarray[int32] [n_cells]: kvcache.cells FREE, SHARED, or the owner
    slots: list[SlotInfo]
    holder_seq_ids: list[int]  # seq ids that are prefix-cache holders
    stats: EngineStats
    pools: list[PoolMap] = field(default_factory=list)
