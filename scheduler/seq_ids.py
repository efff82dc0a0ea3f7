"""Who holds each seq id of the KV cache: nobody, a running choice, or a prefix-cache holder."""

from __future__ import annotations

import heapq

import numpy as np

from kvcache.memory import Memory
from scheduler.plan import LoraKey
from scheduler.prefix_cache import PrefixCache


class SeqIds:
    def __init__(self, memory: Memory, prefix: PrefixCache, prefix_enabled: bool) -> None:
        self.memory = memory
        self.prefix = prefix
        self.prefix_enabled = prefix_enabled
        self._free = list(range(memory.n_seq_max))  # min-heap

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return heapq.heappop(self._free)

    def peek_free(self) -> int:
        """The id take() would return, without taking it; -1 when none is free."""
        return self._free[0] if self._free else -1

    def claim(self, sid: int) -> bool:
        """Take `sid` itself (a restored slot); False when it is not free."""
        if sid not in self._free:
            return False
        self._free.remove(sid)
        heapq.heapify(self._free)
        return True

    def release(self, sid: int) -> None:
        """`sid` owns no cells any more."""
        assert sid >= 0
        heapq.heappush(self._free, sid)

    def retire(
        self,
        sid: int,
        tokens: np.ndarray,
        cache: bool,
        lora: LoraKey = (),
        lora_name: str | None = None,
    ) -> None:
        """A choice is done with `sid`, whose cells hold `tokens` at positions 0..n-1 (and
        maybe more), computed under `lora`: keep them as a prefix holder, or free everything.
        A holder is kept only if the memory can cut it to `tokens` and some prefix of it
        stays usable."""
        n = tokens.shape[0]
        mem = self.memory
        keep = cache and self.prefix_enabled and n > 0
        keep = keep and not self.prefix.is_covered(tokens, mem.usable_prefix, lora)
        if keep and mem.can_rm(sid, n, -1) and mem.seq_rm(sid, n, -1) and mem.usable_prefix(sid, n):
            # NOTE: a holder is redundant only where the new one serves its whole length (a
            # recurrent state serves only the lengths it kept a state for)
            usable = lambda m: mem.usable_prefix(sid, m)  # noqa: E731
            for holder in self.prefix.covered_by(tokens, usable, lora):
                self.drop_holder(holder)
            self.prefix.insert(sid, tokens, lora, lora_name)
            return
        mem.seq_rm(sid, -1, -1)
        self.release(sid)

    def drop_holder(self, sid: int) -> None:
        self.prefix.remove(sid)
        self.memory.seq_rm(sid, -1, -1)
        self.release(sid)

    def drop_lru_holder(self, exclude: int = -1) -> bool:
        """False when there is no holder (other than `exclude`) to drop."""
        sid = self.prefix.lru(exclude)
        if sid < 0:
            return False
        self.drop_holder(sid)
        return True

    def clear_holders(self) -> None:
        for sid in self.prefix.seq_ids:
            self.drop_holder(sid)
