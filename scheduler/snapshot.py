"""Read-only snapshots of a Scheduler for the engine's stats(), slots() and cell_map()."""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

import numpy as np

from kvcache.cell_types import PoolCells
from kvcache.cells import SHARED
from kvcache.memory import Memory
from scheduler.scheduler import Scheduler
from scheduler.sequence import SeqState, Sequence
from scheduler.stats import EngineStats, PoolMap, PoolUsage, SlotInfo


def pool_maps(
    memory: Memory, state_bytes_per_slot: int = 0, cell_bytes: Seq[int] = ()
) -> list[PoolMap]:
    """Per pool; `state_bytes_per_slot`: the worker's, for pools of state slots; `cell_bytes`:
    pool_cell_bytes, for pools of K/V cells (empty: not known)."""
    return [
        PoolMap(
            p.name,
            p.window,
            p.cells.n_cells,
            int(p.cells.head),
            p.cells.owner_map(),
            p.kind,
            _unit_bytes(p.kind, i, state_bytes_per_slot, cell_bytes),
        )
        for i, p in enumerate(memory.pools)
    ]


def pool_cell_bytes(memory: Memory, group_bytes: Seq[int]) -> list[int]:
    """Per pool, one cell's K/V bytes as stored (the worker's per layer group, summed over the
    groups the pool holds); 0 for pools of state slots or where `group_bytes` is empty."""
    return [
        sum(b for g, b in zip(memory.group_pools, group_bytes, strict=False) if g == i)
        for i in range(len(memory.pools))
    ]


def _unit_bytes(kind: str, i: int, state_bytes_per_slot: int, cell_bytes: Seq[int]) -> int:
    if kind == "slots":
        return state_bytes_per_slot
    return cell_bytes[i] if i < len(cell_bytes) else 0


def main_pool(memory: Memory) -> PoolCells:
    """What the unlabelled cell numbers describe: the first pool of K/V cells, or the state
    slots of a memory without any."""
    return next((p.cells for p in memory.pools if p.kind == "cells"), memory.pools[0].cells)


def _lora_ids(seqs: Iterable[Sequence]) -> tuple[int, ...]:
    return tuple(sorted({aid for s in seqs for aid, _ in s.request.lora}))


def engine_stats(
    sched: Scheduler,
    alive: bool,
    draining: bool,
    state_bytes_per_slot: int = 0,
    cell_bytes: Seq[int] = (),
) -> EngineStats:
    cells = main_pool(sched.memory)
    cstats = cells.stats()
    running_cells = [cells.seq_cells(s.seq_id)[0] for s in sched.running]
    num_running_cells = np.unique(np.concatenate(running_cells)).size if running_cells else 0
    c = sched.counters
    radix = sched.seq_ids.radix
    held = getattr(cells, "held", None)  # KVCells' (kvcache/held_cells.py)
    num_owners = getattr(cells, "num_owners", None)
    index_only = 0 if held is None else int(np.count_nonzero(held & (num_owners == 1)))
    return EngineStats(
        num_waiting=sum(s.num_seq_ids for s in sched.waiting),
        num_running=len(sched.running),
        n_cells=cells.n_cells,
        cells_used=cstats.used,
        cells_shared=cstats.shared,
        cells_cached=cstats.used - int(num_running_cells),
        prefix_cache_queried_tokens=c.prefix_queried_tokens,
        prefix_cache_hit_tokens=c.prefix_hit_tokens,
        prefix_cache_running_hit_tokens=c.prefix_running_hit_tokens,
        prefix_index_nodes=radix.num_nodes if radix is not None else 0,
        prefix_index_cells=radix.num_cells if radix is not None else 0,
        prefix_index_window_cells=sum(radix.num_window_cells) if radix is not None else 0,
        cells_index_only=index_only,
        spec=sched.spec.snapshot(),
        running_lora_ids=_lora_ids(sched.running),
        waiting_lora_ids=_lora_ids(sched.waiting),
        num_context_shifts=c.num_context_shifts,
        num_preemptions=c.num_preemptions,
        num_prompt_tokens=c.num_prompt_tokens,
        num_generated_tokens=c.num_generated_tokens,
        num_steps=c.num_steps,
        alive=alive,
        draining=draining,
        pools=[
            PoolUsage(
                p.name,
                p.window,
                p.cells.n_cells,
                p.cells.used,
                ps.stats.shared,
                p.kind,
                _unit_bytes(p.kind, i, state_bytes_per_slot, cell_bytes),
            )
            for i, (p, ps) in enumerate(zip(sched.memory.pools, sched.memory.stats(), strict=True))
        ],
    )


def slot_infos(sched: Scheduler) -> list[SlotInfo]:
    owner_map = main_pool(sched.memory).owner_map()
    slots = [_running_slot(sched, s, owner_map) for s in sched.running]
    for seq in sched.waiting:
        slots.extend(_waiting_slot(s) for s in [seq, *seq.forks])
    return slots


def _running_slot(sched: Scheduler, seq: Sequence, owner_map: np.ndarray) -> SlotInfo:
    kv_cells, _ = main_pool(sched.memory).seq_cells(seq.seq_id)
    return SlotInfo(
        req_id=seq.req_id,
        index=seq.index,
        seq_id=seq.seq_id,
        state="decode" if seq.num_generated else "prefill",
        num_prompt=seq.num_prompt,
        num_computed=seq.num_computed,
        num_generated=seq.num_generated,
        cells_owned=int(kv_cells.size),
        cells_shared=int(np.count_nonzero(owner_map[kv_cells] == SHARED)),
        pos_min=sched.memory.seq_pos_min(seq.seq_id),
        pos_max=sched.memory.seq_pos_max(seq.seq_id),
    )


def _waiting_slot(seq: Sequence) -> SlotInfo:
    assert seq.state is SeqState.WAITING
    return SlotInfo(
        req_id=seq.req_id,
        index=seq.index,
        seq_id=-1,
        state="waiting",
        num_prompt=seq.num_prompt,
        num_computed=0,
        num_generated=seq.num_generated,
        cells_owned=0,
        cells_shared=0,
        pos_min=-1,
        pos_max=-1,
    )
