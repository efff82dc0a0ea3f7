"""Prefix cache index: finished sequences' cells stay in the KV cache under holder seq ids.

The index is flat: one token array per holder, matched by a vectorised compare. Holders are
bounded by n_seq_max (tens to hundreds), so a match is a few numpy calls, and it needs no
tree maintenance when holders come and go. A holder is keyed by its tokens AND the LoRA
adapters they were computed under (`lora`): K/V computed under one adapter is never another's
(vLLM puts the LoRA in its block hashes). The scheduler does the memory operations
(`seq_cp` from the holder, `seq_rm` of dropped holders); this class only decides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from scheduler.kv_blocks import BlockLedger
from scheduler.plan import LoraKey

if TYPE_CHECKING:
    from scheduler.radix import RadixMatch

Usable = Callable[[int, int], int]


@dataclass(slots=True)
class Holder:
    seq_id: int
    tokens: np.ndarray  # [n] int64: the holder owns these tokens at positions 0..n-1
    last_used: int
    lora: LoraKey = ()
    lora_name: str | None = None  # what KV events call `lora` (None: the base model)


@dataclass(slots=True)
class PrefixMatch:
    seq_id: int  # -1: no match
    length: int
    holder: bool = True  # False: a running sequence's computed cells (scheduler/sharing.py)
    radix: RadixMatch | None = None  # cells held by the prefix index (seq_id -1): cells_cp


def uses_adapter(lora: LoraKey, adapter_id: int) -> bool:
    return any(aid == adapter_id for aid, _ in lora)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.shape[0], b.shape[0])
    if m == 0:
        return 0
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


class PrefixCache:
    def __init__(self) -> None:
        self._holders: dict[int, Holder] = {}
        self._clock = 0
        self.ledger: BlockLedger | None = None  # virtual blocks for KV events, when enabled

    def __len__(self) -> int:
        return len(self._holders)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._holders

    @property
    def seq_ids(self) -> list[int]:
        return sorted(self._holders)

    def match(
        self, tokens: np.ndarray, usable: Usable | None = None, lora: LoraKey = ()
    ) -> PrefixMatch:
        """Longest cached prefix of `tokens` under `lora`; never mutates. `usable(seq_id, n)`:
        the longest m <= n of a holder's first n tokens that can be reused (usable_prefix)."""
        best, best_used = PrefixMatch(-1, 0), -1
        for h in self._holders.values():
            if h.lora != lora:
                continue
            n = common_prefix_len(h.tokens, tokens)
            if usable is not None and n >= best.length and n > 0:
                n = usable(h.seq_id, n)
            # NOTE: among equal matches the most recently used: a match touches its holder, so
            # always taking the oldest would keep it alive forever on a few shared tokens
            if n > best.length or (n == best.length > 0 and h.last_used > best_used):
                best, best_used = PrefixMatch(h.seq_id, n), h.last_used
        return best

    def is_covered(
        self, tokens: np.ndarray, usable: Usable | None = None, lora: LoraKey = ()
    ) -> bool:
        """Some holder already holds all of `tokens` as its prefix (and, with `usable`, can
        serve that whole prefix: a recurrent state only serves the lengths it kept)."""
        n = tokens.shape[0]
        return any(
            h.tokens.shape[0] >= n
            and h.lora == lora
            and common_prefix_len(h.tokens, tokens) == n
            and (usable is None or usable(h.seq_id, n) == n)
            for h in self._holders.values()
        )

    def covered_by(
        self, tokens: np.ndarray, usable: Callable[[int], int] | None = None, lora: LoraKey = ()
    ) -> list[int]:
        """Holders whose whole content is a prefix of `tokens` (made redundant by it; with
        `usable(n)`, the longest m <= n the new holder serves, only those it fully serves)."""
        return [
            h.seq_id
            for h in self._holders.values()
            if h.tokens.shape[0] <= tokens.shape[0]
            and h.lora == lora
            and common_prefix_len(h.tokens, tokens) == h.tokens.shape[0]
            and (usable is None or usable(h.tokens.shape[0]) == h.tokens.shape[0])
        ]

    def insert(
        self, seq_id: int, tokens: np.ndarray, lora: LoraKey = (), lora_name: str | None = None
    ) -> None:
        assert seq_id not in self._holders
        self._clock += 1
        self._holders[seq_id] = Holder(seq_id, tokens, self._clock, lora, lora_name)
        if self.ledger is not None:
            self.ledger.add(seq_id, tokens, lora, lora_name)

    def tokens(self, seq_id: int) -> np.ndarray:
        return self._holders[seq_id].tokens

    def last_used(self, seq_id: int) -> int:
        """The clock of the holder's last insert or touch (larger: more recent)."""
        return self._holders[seq_id].last_used

    def lora(self, seq_id: int) -> LoraKey:
        return self._holders[seq_id].lora

    def lora_name(self, seq_id: int) -> str | None:
        return self._holders[seq_id].lora_name

    def computed_under(self, adapter_id: int) -> list[int]:
        """The holders computed under adapter `adapter_id`, alone or in a mix."""
        return [h.seq_id for h in self._holders.values() if uses_adapter(h.lora, adapter_id)]

    def touch(self, seq_id: int) -> None:
        self._clock += 1
        self._holders[seq_id].last_used = self._clock

    def remove(self, seq_id: int) -> None:
        del self._holders[seq_id]
        if self.ledger is not None:
            self.ledger.remove(seq_id)

    def lru(self, exclude: int = -1) -> int:
        """The least recently used holder other than `exclude`, or -1."""
        cands = [h for h in self._holders.values() if h.seq_id != exclude]
        if not cands:
            return -1
        return min(cands, key=lambda h: h.last_used).seq_id
