"""llama.cpp's slot save/restore on a cache of cells (`POST /slots/{id}?action=save|restore|
erase`, server/routes_slots.py).

A llama.cpp slot keeps its last prompt's cells for the next request; here a finished
conversation's cells stay under its seq id as a prefix-cache holder, so slot N is seq id N and
what it holds is that holder's tokens and cells (on a recurrent or hybrid model, the state
after its last token in place of the recurrent layers' cells, as llama.cpp's state files keep
a recurrent cell). A restored slot is a holder again: the next request whose prompt starts with
its tokens takes them with seq_cp (cached_tokens), exactly as if the conversation had just
finished here. Every function runs on the engine thread between two steps (Engine.call), so
the worker is idle and the cells cannot move under it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler.plan import LoraKey
from scheduler.scheduler import Scheduler


class SlotError(Exception):
    """A slot operation that cannot be done; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class SlotCells:
    """What slot `seq_id` holds: its tokens (positions 0..n-1) and, per layer group of the
    model's MemorySpec, the cells that group keeps for it and their positions (sorted;
    Memory.seq_rows: a recurrent group's one state slot at n - 1), and the LoRA adapters its
    K/V was computed under."""

    seq_id: int
    tokens: np.ndarray
    cells: list[np.ndarray]
    positions: list[np.ndarray]
    lora: LoraKey = ()
    lora_name: str | None = None


def _check(sched: Scheduler, seq_id: int) -> None:
    n = sched.memory.n_seq_max
    if not 0 <= seq_id < n:
        raise SlotError(400, f"id_slot {seq_id} is out of range: this server has slots 0..{n - 1}")
    if any(s.seq_id == seq_id for s in sched.running):
        raise SlotError(409, f"slot {seq_id} is busy with a running request; retry when it ends")


def slot_cells(sched: Scheduler, seq_id: int, length: int | None = None) -> SlotCells:
    """What slot `seq_id` holds (never mutates), or its first `length` tokens' part (a length
    Memory.prefix_lengths gives); SlotError if it is busy or holds nothing."""
    _check(sched, seq_id)
    if seq_id not in sched.prefix:
        raise SlotError(400, f"slot {seq_id} holds no cached prompt to save")
    tokens = sched.prefix.tokens(seq_id)[:length]
    # a recurrent state serves only the lengths it kept a state for (a holder's whole length)
    n = sched.memory.usable_prefix(seq_id, int(tokens.shape[0]))
    if n <= 0:
        raise SlotError(400, f"slot {seq_id} holds no reusable prompt to save")
    tokens = tokens[:n]
    rows = sched.memory.seq_rows(seq_id, n)
    cells, positions = [c for c, _ in rows], [p for _, p in rows]
    return SlotCells(
        seq_id, tokens, cells, positions, sched.prefix.lora(seq_id), sched.prefix.lora_name(seq_id)
    )


def erase_slot(sched: Scheduler, seq_id: int) -> int:
    """Forget what slot `seq_id` holds; -> how many tokens it held (0: nothing)."""
    _check(sched, seq_id)
    if seq_id not in sched.prefix:
        return 0
    n = int(sched.prefix.tokens(seq_id).shape[0])
    sched.seq_ids.drop_holder(seq_id)
    return n


def restore_slot(
    sched: Scheduler,
    seq_id: int,
    tokens: np.ndarray,
    lora: LoraKey = (),
    lora_name: str | None = None,
) -> list[np.ndarray]:
    """Make slot `seq_id` a prefix-cache holder of `tokens` (computed under `lora`) at
    positions 0..n-1 in fresh cells
    (dropping what it held, and least recently used holders where the cache is full) -> per
    layer group, the cell of each position 0..n-1 (-1 where the group no longer keeps it: a
    sliding window's old rows); the caller writes the K/V rows into them. SlotError (nothing
    changed) when they do not fit."""
    _check(sched, seq_id)
    n = int(tokens.shape[0])
    if n == 0:
        raise SlotError(400, "the slot file holds no tokens")
    if n > sched.config.n_ctx_seq:
        raise SlotError(
            400,
            f"the slot holds {n} tokens, past this server's context of "
            f"{sched.config.n_ctx_seq} per sequence",
        )
    if seq_id in sched.prefix:
        sched.seq_ids.drop_holder(seq_id)
    if not sched.seq_ids.claim(seq_id):
        raise SlotError(409, f"slot {seq_id} is in use")
    mem = sched.memory
    chunk = max(1, sched.config.n_batch)
    for start in range(0, n, chunk):
        pos = np.arange(start, min(n, start + chunk), dtype=np.int64)
        ids = np.full(pos.shape, seq_id, dtype=np.int64)
        plan = mem.plan_written(pos, ids)
        while plan is None and sched.seq_ids.drop_lru_holder(exclude=seq_id):
            plan = mem.plan_written(pos, ids)
        if plan is None:
            mem.seq_rm(seq_id, -1, -1)
            sched.seq_ids.release(seq_id)
            raise SlotError(
                503, f"the cache has no room for the slot's {n} tokens while requests hold it"
            )
        mem.apply(plan)
    mem.seq_trim(seq_id)  # a window's older rows: owned, but not in the file
    # what the sequence keeps: not a sliding window's older rows (their cells may be another
    # row's now), of a recurrent state only the state after the last position
    rows = []
    for cells, kept in mem.seq_rows(seq_id, n):
        at = np.full(n, -1, dtype=np.int64)
        at[kept] = cells
        rows.append(at)
    sched.prefix.insert(seq_id, np.asarray(tokens, dtype=np.int64).copy(), lora, lora_name)
    return rows
