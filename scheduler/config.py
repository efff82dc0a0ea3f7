"""Engine and scheduler settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvcache.make import make_memory
from kvcache.memory import Memory
from kvcache.spec import MemorySpec
from scheduler.speculative import SpecConfig

MemoryKind = Literal["auto", "unified", "iswa"]


@dataclass(slots=True)
class EngineConfig:
    n_cells: int  # KV cache cells (tokens) shared by every sequence
    n_seq_max: int  # seq ids: running choices plus prefix-cache holders (not the prefix index)
    n_batch: int  # token budget of one step
    n_ctx_seq: int  # context limit of one sequence (positions 0..n_ctx_seq-1)
    context_shift: bool = True  # default for requests that do not say
    max_queue: int = 256  # waiting requests before submit raises QueueFullError
    prefix_cache: bool = True
    # keep finished conversations past the seq ids in the prefix index over held cells
    # (scheduler/radix.py), where the memory can hold cells (the unified cache, and iSWA with
    # swa_index_cells > 0)
    prefix_index: bool = True
    # iSWA: cells each sliding-window pool gets beyond what running sequences can need, for
    # the windows of the conversations the prefix index keeps (None: n_cells // 4; 0: none,
    # so only the n_seq_max holders are remembered)
    swa_index_cells: int | None = None
    # a new request waits for a running prompt's cells (scheduler/sharing.py) when they share
    # at least this many tokens (a chat template's common header alone makes nobody wait)
    prefix_wait_min: int = 32
    seed: int | None = None  # seeds the per-request random seeds (tests); None = OS entropy
    memory_spec: MemorySpec | None = None  # the model's; None: full attention everywhere
    # "auto": iSWA when the spec has sliding-window layers, else unified; "unified" keeps one
    # cell per token for every layer (sliding windows applied as masks)
    memory: MemoryKind = "auto"
    # recurrent and hybrid models: state slots for prefix-cache checkpoints beside one slot
    # per seq id (None: n_seq_max), and the positions between the checkpoints a prompt takes
    state_checkpoints: int | None = None
    state_checkpoint_interval: int = 256
    spec: SpecConfig = field(default_factory=SpecConfig)  # speculative decoding
    # an encoder (bidirectional attention, no cache): every prompt is read whole in one step,
    # never in chunks nor from a cached prefix; needs n_batch >= n_ctx_seq and no prefix cache
    whole_prompts: bool = False

    def validate(self) -> None:
        if self.n_cells < 1 or self.n_seq_max < 1 or self.n_batch < 1 or self.max_queue < 0:
            raise ValueError(f"bad engine config: {self}")
        if not 8 <= self.n_ctx_seq <= self.n_cells:
            raise ValueError(f"n_ctx_seq must be in [8, n_cells={self.n_cells}]: {self}")
        if self.state_checkpoints is not None and self.state_checkpoints < 0:
            raise ValueError(f"state_checkpoints must be >= 0: {self}")
        if self.prefix_wait_min < 1:
            raise ValueError(f"prefix_wait_min must be >= 1: {self}")
        if self.state_checkpoint_interval < 1:
            raise ValueError(f"state_checkpoint_interval must be >= 1: {self}")
        self.spec.validate()
        if self.whole_prompts and (self.prefix_cache or self.n_batch < self.n_ctx_seq):
            raise ValueError(f"whole prompts need n_batch >= n_ctx_seq and no prefix cache: {self}")
        if self.swa_index_cells is not None and self.swa_index_cells < 0:
            raise ValueError(f"swa_index_cells must be >= 0: {self}")
        if self.memory not in ("auto", "unified", "iswa"):
            raise ValueError(f"memory must be auto, unified or iswa, got {self.memory!r}")

    def make_memory(self) -> Memory:
        """The memory this config describes (build the worker's storage for the same one)."""
        return make_memory(
            self.memory_spec,
            self.n_cells,
            self.n_seq_max,
            self.n_batch,
            self.memory,
            n_ckpt=self.state_checkpoints,
            ckpt_interval=self.state_checkpoint_interval,
            index_cells=self.index_cells,
        )

    @property
    def index_cells(self) -> int:
        """Cells of each sliding-window pool for the prefix index (make_memory)."""
        if not (self.prefix_cache and self.prefix_index):
            return 0
        return self.n_cells // 4 if self.swa_index_cells is None else self.swa_index_cells
