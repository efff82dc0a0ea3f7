"""What a store of the prefix cache's second tier holds (kvcache/tier_store.py), as the
scheduler's index reads it (scheduler/cache_tier.py): torch-free, so the scheduler stays so."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class StoredEntry:
    """One entry a store already holds for this model (a disk store after a restart)."""

    key: str
    tokens: np.ndarray  # [n] int64 at positions 0..n-1
    nbytes: int
    lora: tuple[tuple[int, float], ...] = ()  # scheduler.plan.LoraKey
    lora_name: str | None = None
