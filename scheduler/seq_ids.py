"""Who holds each seq id of the KV cache: nobody, a running choice, or a prefix-cache holder.

Where the memory holds cells itself, a holder whose seq id is wanted is demoted into the prefix
index (scheduler/radix.py) and keeps its cells; under memory pressure the index's least
recently used leaf goes before any holder."""

from __future__ import annotations

import heapq

import numpy as np

from kvcache.memory import Memory
from scheduler.plan import LoraKey
from scheduler.prefix_cache import PrefixCache
from scheduler.radix import Node, RadixCache


class SeqIds:
    def __init__(
        self, memory: Memory, prefix: PrefixCache, prefix_enabled: bool, index: bool = True
    ) -> None:
        self.memory = memory
        self.prefix = prefix
        self.prefix_enabled = prefix_enabled
        index = index and prefix_enabled and memory.holds_cells
        self.radix = RadixCache(memory) if index else None
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

    def demote_holder(self, sid: int) -> None:
        """Free `sid` and keep what it holds in the prefix index (or drop it without one)."""
        if self.radix is not None:
            tokens = self.prefix.tokens(sid)
            n = int(tokens.shape[0])
            cells = self.memory.seq_prefix_cells(sid, n)
            window = self.memory.seq_window_cells(sid, n)  # [] without sliding-window pools
            lora, name = self.prefix.lora(sid), self.prefix.lora_name(sid)
            self.radix.insert(tokens, cells, lora, name, window)
        self.drop_holder(sid)

    def free_lru_id(self, exclude: int = -1) -> bool:
        """Free a seq id by demoting the least recently used holder (other than `exclude`);
        False when there is none."""
        sid = self.prefix.lru(exclude)
        if sid < 0:
            return False
        self.demote_holder(sid)
        return True

    def drop_lru_holder(self, exclude: int = -1) -> bool:
        """Free cells: evict the prefix index's least recently used leaf, or else drop the
        least recently used holder (other than `exclude`). False when there is neither."""
        if self.radix is not None and self.radix.evict_lru():
            return True
        sid = self.prefix.lru(exclude)
        if sid < 0:
            return False
        self.drop_holder(sid)
        return True

    def radix_lock(self, node: Node | None, delta: int) -> None:
        if self.radix is not None:
            self.radix.lock(node, delta)

    def radix_touch(self, node: Node | None) -> None:
        if self.radix is not None:
            self.radix.touch(node)

    def drop_adapter(self, adapter_id: int) -> None:
        """Free what the holders and the prefix index keep computed under `adapter_id`."""
        for sid in self.prefix.computed_under(adapter_id):
            self.drop_holder(sid)
        if self.radix is not None:
            self.radix.drop_adapter(adapter_id)

    def clear_holders(self) -> None:
        for sid in self.prefix.seq_ids:
            self.drop_holder(sid)
        if self.radix is not None:
            self.radix.clear()
