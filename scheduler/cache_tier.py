"""A second tier for the prefix cache: host RAM (`--cache-ram`, llama.cpp's flag) and a disk
that survives restarts (`--cache-dir`).

Every prefix-cache holder of at least `min_tokens` tokens is copied out when it appears (its tokens
and K/V rows as stored, and on a recurrent or hybrid model the state after its last token: what a
slot file keeps, scheduler/saved_slots.py) and given to each store,
which keeps it within its byte budget, least recently used out first. When the live cache later
evicts the holder under pressure, the copy stays. The prefix index over held cells
(scheduler/radix.py) holds only demoted holders, each copied out when it was a holder, so what the
index evicts is in the tier too (within the tier's budget) with nothing copied at eviction. A queued
request whose prompt matches a stored entry by at least `min_gain` tokens more than anything live
waits while the entry is read (off the engine thread), is restored into fresh cells as a holder
again, and is then admitted as an ordinary prefix hit. A restarted server indexes what its disk
store holds for the same model file.

Torch-free: the rows are whatever the store's worker side makes of them (kvcache/tier_store.py).
Every method runs on the engine thread between two steps (scheduler/engine.py).
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvcache.tier_entry import StoredEntry
from scheduler.plan import LoraKey
from scheduler.prefix_cache import common_prefix_len
from scheduler.saved_slots import SlotCells, SlotError, restore_slot, slot_cells
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from scheduler.sharing import query_tokens

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TierEntry:
    key: str
    tokens: np.ndarray  # [n] int64 at positions 0..n-1
    nbytes: int
    last_used: int = 0
    lora: LoraKey = ()  # the LoRA adapters its K/V was computed under: serves only those
    lora_name: str | None = None


class TierStore(Protocol):
    """Where entries live (kvcache/tier_store.py: RamStore, DiskStore)."""

    name: str  # "ram" | "disk": the tier label in /metrics
    max_bytes: int

    def entries(self) -> list[StoredEntry]:
        """What the store already holds for this model (a disk store after a restart), oldest
        first."""
        ...

    def put(self, key: str, held: SlotCells, worker: Any) -> int:
        """Copy `held`'s rows out of the worker's storage and keep them under `key`
        -> bytes kept, or -1 when the store dropped it (its writer is behind)."""
        ...

    def get(self, key: str) -> Future[Any]:
        """The entry, read and verified off the engine thread (an error if it is damaged)."""
        ...

    def write(self, entry: Any, cells: list[np.ndarray], worker: Any) -> None:
        """Write a got entry's rows into the worker's storage: `cells`, per layer group, the
        cell of each position 0..n-1 (-1: not kept); raises ValueError for a wrong layout."""
        ...

    def drop(self, key: str) -> None: ...


@dataclass(slots=True)
class TierStats:
    entries: int = 0
    bytes: int = 0
    saves: int = 0
    dropped_saves: int = 0
    hits: int = 0  # entries restored into the live cache
    hit_tokens: int = 0
    failed_loads: int = 0


@dataclass(slots=True)
class _Load:
    store: int
    entry: TierEntry
    future: Future[Any]
    waiters: list[Sequence] = field(default_factory=list)


def whole_length_only(sched: Scheduler) -> bool:
    """Whether an entry serves only prompts that start with all of its tokens: a sliding
    window keeps the rows of its last positions only, a recurrent state is the state after the
    last token."""
    return any(p.window > 0 or p.kind != "cells" for p in sched.memory.pools)


class CacheTier:
    def __init__(
        self,
        stores: list[TierStore],
        model: str,
        min_tokens: int = 64,
        min_gain: int = 32,
        num_fixed_loras: int | None = None,
    ) -> None:
        """`model`: the model file's fingerprint, part of every key. `num_fixed_loras`: the
        LoRA ids below it are the start-up adapters, in the fingerprint; K/V computed under a
        later id (loaded at runtime, server/lora_runtime.py) is not kept, since after a restart
        that id may be another adapter's. None: every id is fixed."""
        self.stores = stores
        self.model = model
        self.num_fixed_loras = num_fixed_loras
        self.min_tokens = max(1, min_tokens)
        self.min_gain = max(1, min_gain)
        self.index: list[dict[str, TierEntry]] = []
        self.stats = [TierStats() for _ in stores]
        self._clock = 0
        for i, store in enumerate(stores):
            entries = {  # oldest first: the least recently used
                e.key: TierEntry(e.key, e.tokens, e.nbytes, age, e.lora, e.lora_name)
                for age, e in enumerate(store.entries())
            }
            self.index.append(entries)
            self.stats[i].entries = len(entries)
            self.stats[i].bytes = sum(e.nbytes for e in entries.values())
        self._seen: dict[int, int] = {}  # holder seq id -> id() of the tokens it was seen with
        self._loads: dict[str, _Load] = {}

    def key(self, tokens: np.ndarray, lora: LoraKey = ()) -> str:
        h = hashlib.sha256(self.model.encode())
        h.update(repr(tuple(lora)).encode())
        h.update(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
        return h.hexdigest()[:40]

    # ---- saving ---------------------------------------------------------------------------

    def after_update(self, sched: Scheduler, worker: Any) -> None:
        """Copy out the holders that appeared since the last call."""
        live = set(sched.prefix.seq_ids)
        for sid in list(self._seen):
            if sid not in live:
                del self._seen[sid]
        for sid in live:
            tokens = sched.prefix.tokens(sid)
            if self._seen.get(sid) == id(tokens):
                continue
            self._seen[sid] = id(tokens)
            if tokens.shape[0] >= self.min_tokens:
                self._save(sched, sid, tokens, worker)

    def _save(self, sched: Scheduler, sid: int, tokens: np.ndarray, worker: Any) -> None:
        """Copy out what holder `sid` serves: its whole length, and on a recurrent or hybrid
        model each shorter length it kept a state for (a checkpoint: the end of a shared
        system prompt's grid point, the prompt before its last token), shortest first so that
        the whole conversation is the most recently used."""
        lora, lora_name = sched.prefix.lora(sid), sched.prefix.lora_name(sid)
        fixed = self.num_fixed_loras
        if fixed is not None and any(aid >= fixed for aid, _ in lora):
            return
        lengths = sched.memory.prefix_lengths(sid, int(tokens.shape[0]))
        for m in sorted(m for m in lengths if m >= self.min_tokens):
            self._save_prefix(sched, sid, tokens[:m], lora, lora_name, worker)

    def _save_prefix(
        self,
        sched: Scheduler,
        sid: int,
        tokens: np.ndarray,
        lora: LoraKey,
        lora_name: str | None,
        worker: Any,
    ) -> None:
        key = self.key(tokens, lora)
        held: SlotCells | None = None
        whole = whole_length_only(sched)
        for i, store in enumerate(self.stores):
            index = self.index[i]
            if key in index:
                self._touch(index[key])
                continue
            if held is None:
                held = slot_cells(sched, sid, int(tokens.shape[0]))
            nbytes = store.put(key, held, worker)
            if nbytes < 0:
                self.stats[i].dropped_saves += 1
                continue
            self._clock += 1
            index[key] = TierEntry(key, tokens.copy(), nbytes, self._clock, lora, lora_name)
            self.stats[i].saves += 1
            if not whole:  # a full-attention entry serves every prefix of itself
                for k, e in list(index.items()):
                    n = e.tokens.shape[0]
                    covered = (
                        e.lora == lora
                        and n <= tokens.shape[0]
                        and common_prefix_len(e.tokens, tokens) == n
                    )
                    if k != key and covered and k not in self._loads:
                        self._drop(i, k)
            self._fit(i)
            self._count(i)

    def _fit(self, i: int) -> None:
        index, store = self.index[i], self.stores[i]
        total = sum(e.nbytes for e in index.values())
        for e in sorted(index.values(), key=lambda e: e.last_used):
            if total <= store.max_bytes:
                break
            if e.key in self._loads:
                continue
            total -= e.nbytes
            self._drop(i, e.key)

    def _drop(self, i: int, key: str) -> None:
        self.index[i].pop(key, None)
        self.stores[i].drop(key)

    def _count(self, i: int) -> None:
        self.stats[i].entries = len(self.index[i])
        self.stats[i].bytes = sum(e.nbytes for e in self.index[i].values())

    def _touch(self, entry: TierEntry) -> None:
        self._clock += 1
        entry.last_used = self._clock

    # ---- loading --------------------------------------------------------------------------

    def before_schedule(self, sched: Scheduler, worker: Any) -> None:
        """Restore the entries whose reads finished; start reads for queued requests that a
        stored entry serves better than the live cache."""
        for key, load in list(self._loads.items()):
            if load.future.done():
                del self._loads[key]
                self._finish(sched, worker, load)
        if not sched.config.prefix_cache:
            return
        whole = whole_length_only(sched)
        for seq in list(sched.waiting)[: max(1, sched.config.n_seq_max)]:
            if seq.tier_checked or seq.request.embed:
                continue
            seq.tier_checked = True
            tokens, lora = query_tokens(seq), seq.request.lora
            best: tuple[int, int, TierEntry] | None = None
            for i, index in enumerate(self.index):
                for e in index.values():
                    if e.lora != lora:
                        continue  # K/V computed under other adapters serves nobody here
                    n = common_prefix_len(e.tokens, tokens)
                    if whole and n < e.tokens.shape[0]:
                        continue
                    if best is None or n > best[0]:
                        best = (n, i, e)
            if best is None:
                continue
            n, i, entry = best
            live = sched.sharing.cached(tokens, lora).length
            if n - live < self.min_gain:
                continue
            if entry.key not in self._loads:
                self._loads[entry.key] = _Load(i, entry, self.stores[i].get(entry.key))
            self._loads[entry.key].waiters.append(seq)
            seq.tier_wait = True

    def _finish(self, sched: Scheduler, worker: Any, load: _Load) -> None:
        for seq in load.waiters:
            seq.tier_wait = False
        i, entry = load.store, load.entry
        try:
            got = load.future.result()
        except Exception as exc:  # noqa: BLE001 - a bad entry is dropped, never restored
            self._discard(i, entry.key, exc)
            return
        if sched.prefix.is_covered(entry.tokens, sched.memory.usable_prefix, entry.lora):
            return  # the live cache got it meanwhile
        if sched.sharing.cached(entry.tokens, entry.lora).length >= entry.tokens.shape[0]:
            return  # the prefix index has it
        sid = sched.seq_ids.peek_free()
        if sid < 0 and sched.seq_ids.free_lru_id():
            sid = sched.seq_ids.peek_free()
        if sid < 0:
            return  # every seq id runs: the waiters compute their prompts
        try:
            cells = restore_slot(sched, sid, entry.tokens, entry.lora, entry.lora_name)
        except SlotError as exc:
            log.info(
                "cache tier %s: no room to restore %d tokens: %s",
                self.stores[i].name,
                entry.tokens.shape[0],
                exc,
            )
            return
        try:
            self.stores[i].write(got, cells, worker)
        except Exception as exc:  # noqa: BLE001
            sched.seq_ids.drop_holder(sid)
            self._discard(i, entry.key, exc)
            return
        self._seen[sid] = id(sched.prefix.tokens(sid))  # it is stored already
        self._touch(entry)
        self.stats[i].hits += 1
        self.stats[i].hit_tokens += int(entry.tokens.shape[0])

    def _discard(self, i: int, key: str, why: BaseException) -> None:
        log.warning("cache tier %s: entry %s discarded: %s", self.stores[i].name, key, why)
        self.stats[i].failed_loads += 1
        self._drop(i, key)
        self._count(i)

    def close(self) -> None:
        """Stop reading; let the stores finish their queued writes."""
        for load in self._loads.values():
            load.future.cancel()
            for seq in load.waiters:
                seq.tier_wait = False
        self._loads.clear()
        for store in self.stores:
            close = getattr(store, "close", None)
            if close is not None:
                close()
