"""Slot save/restore on the cells (scheduler/saved_slots.py): what a finished conversation
holds is read out, erased, and restored into fresh cells (another slot, a full cache) such that
a continuation takes it as a prefix hit and generates exactly what a cold run would; on the
unified, sliding-window, recurrent and hybrid memories (a state is saved and written back
whole). Busy, empty and out-of-range slots and a cache without
room are refused with nothing changed and nothing leaked."""

from __future__ import annotations

import numpy as np
import pytest

from kvcache.spec import Attention, MemorySpec, Recurrent
from scheduler.request import Request
from scheduler.saved_slots import SlotError, erase_slot, restore_slot, slot_cells
from scheduler.scheduler import Scheduler
from tests.scheduler.fakes import (
    FakeWorker,
    Outcome,
    make_config,
    make_prompt,
    make_request,
    reference_output,
    run,
    step,
)

W = 16
STATE = Recurrent(((3, 8), (2, 4, 4)))
SPECS = {  # memory spec, the window of each layer group (a recurrent state sees everything)
    "unified": (None, (0,)),
    "iswa": (MemorySpec.of([Attention(1, 4), Attention(1, 4, W)]), (0, W)),
    "recurrent": (MemorySpec.of([STATE, STATE]), (0,)),
    "hybrid": (MemorySpec.of([STATE, Attention(1, 4), STATE]), (0, 0)),
}
PROMPT = make_prompt(150, seed=5)


def make(kind: str, **kw: object) -> tuple[Scheduler, FakeWorker]:
    spec, _ = SPECS[kind]
    base = {"n_cells": 512, "n_seq_max": 4, "n_batch": 64, "n_ctx_seq": 400, **kw}
    config = make_config(memory_spec=spec, **base)
    return Scheduler(config), FakeWorker(config.n_cells)


def request(req_id: str, prompt: list[int], max_tokens: int = 6) -> Request:
    req = make_request(req_id, max_tokens=max_tokens)
    req.prompt_ids = list(prompt)
    return req


def is_state(sched: Scheduler, g: int) -> bool:
    mem = sched.memory
    return mem.pools[mem.group_pools[g]].kind == "slots"


def save(sched: Scheduler, worker: FakeWorker, sid: int) -> tuple[np.ndarray, list]:
    """What a slot file keeps: the tokens and, per group, positions + the fake K/V rows (a
    recurrent group: its slots' fake states)."""
    held = slot_cells(sched, sid)
    rows = []
    for g, (cells, pos) in enumerate(zip(held.cells, held.positions, strict=True)):
        if is_state(sched, g):
            rows.append((pos, [worker.states.slots[c] for c in cells.tolist()], None))
        else:
            rows.append((pos, worker.token[g][cells].copy(), worker.k_pos[g][cells].copy()))
    return held.tokens.copy(), rows


def restore(sched: Scheduler, worker: FakeWorker, sid: int, tokens: np.ndarray, rows) -> None:
    cells = restore_slot(sched, sid, tokens)
    for g, (pos, token, k_pos) in enumerate(rows):
        at = cells[g][pos]
        keep = at >= 0
        if is_state(sched, g):
            assert keep.all() and (cells[g] >= 0).sum() == len(token) == 1, "one state, kept"
            worker.states.slots[int(at[0])] = token[0]
            continue
        worker.token[g][at[keep]] = token[keep]
        worker.k_pos[g][at[keep]] = k_pos[keep]


@pytest.mark.parametrize("kind", list(SPECS))
def test_a_restored_slot_is_a_prefix_hit_with_the_cold_output(kind: str) -> None:
    sched, worker = make(kind)
    first = request("a", PROMPT)
    out = run(sched, worker, [first])
    conversation = PROMPT + out.tokens[("a", 0)]
    (sid,) = sched.prefix.seq_ids
    tokens, rows = save(sched, worker, sid)
    assert tokens.tolist() == conversation[: tokens.shape[0]]
    assert tokens.shape[0] >= len(PROMPT)
    assert erase_slot(sched, sid) == tokens.shape[0]
    assert len(sched.prefix) == 0 and sched.memory.num_used == 0
    # other work reuses the freed cells before the restore
    run(sched, worker, [request("other", make_prompt(200, seed=9))])
    target = 3 if sid != 3 else 2
    restore(sched, worker, target, tokens, rows)
    sched.memory.check()
    assert target in sched.prefix
    follow = request("b", conversation + make_prompt(12, seed=11), max_tokens=8)
    out2 = run(sched, worker, [follow])
    assert out2.finish[("b", 0)].num_cached_tokens >= tokens.shape[0] - 1
    windows = SPECS[kind][1]
    assert out2.tokens[("b", 0)] == reference_output(follow, 400, windows=windows)[0]


@pytest.mark.parametrize("cut", [1, 3, 20])
def test_a_restored_window_serves_no_row_it_was_not_given(cut: int) -> None:
    """The restore places its tokens in chunks, so the sliding-window pool still owns rows
    from before the last chunk's window; the file has only the window's. A prompt that leaves
    the conversation `cut` tokens before its end must not read those unwritten cells (the fake
    worker asserts every row it reads holds its position's K): it gets the cold output."""
    sched, worker = make("iswa", n_batch=64)
    run(sched, worker, [request("a", PROMPT)])
    (sid,) = sched.prefix.seq_ids
    tokens, rows = save(sched, worker, sid)
    erase_slot(sched, sid)
    run(sched, worker, [request("other", make_prompt(200, seed=9))])  # reuse the freed cells
    restore(sched, worker, sid, tokens, rows)
    sched.memory.check()
    follow = request("b", tokens[: tokens.shape[0] - cut].tolist() + [7], max_tokens=4)
    out = run(sched, worker, [follow])
    assert out.tokens[("b", 0)] == reference_output(follow, 400, windows=(0, W))[0]


def test_restore_evicts_idle_holders_but_never_a_running_sequence() -> None:
    sched, worker = make("unified", n_cells=300, n_seq_max=4, n_ctx_seq=300)
    run(sched, worker, [request("a", PROMPT)])
    (sid,) = sched.prefix.seq_ids
    tokens, rows = save(sched, worker, sid)
    run(sched, worker, [request("b", make_prompt(120, seed=2))])  # another holder
    # a running request holds cells while the restore needs room
    long = request("c", make_prompt(100, seed=3), max_tokens=50)
    sched.add_request(long)
    outcome = Outcome()
    while not any(s.req_id == "c" and s.num_computed >= 100 for s in sched.running):
        step(sched, worker, outcome)
    free_sid = next(
        i for i in range(4) if i not in sched.prefix and i not in {s.seq_id for s in sched.running}
    )
    restore(sched, worker, free_sid, tokens, rows)
    assert free_sid in sched.prefix and any(s.req_id == "c" for s in sched.running)
    sched.memory.check()
    while sched.has_work:
        step(sched, worker, outcome)
    assert outcome.tokens[("c", 0)] == reference_output(long, 300)[0]


def test_refusals_change_nothing() -> None:
    sched, worker = make("unified", n_cells=200, n_seq_max=4, n_ctx_seq=200)
    with pytest.raises(SlotError) as e:
        slot_cells(sched, 7)
    assert e.value.status == 400 and "out of range" in str(e.value)
    with pytest.raises(SlotError) as e:
        slot_cells(sched, 0)
    assert e.value.status == 400 and "no cached prompt" in str(e.value)
    assert erase_slot(sched, 0) == 0
    # busy: a running sequence's slot
    sched.add_request(request("run", make_prompt(40, seed=4), max_tokens=30))
    step(sched, worker, Outcome())
    busy = sched.running[0].seq_id
    for op in (
        lambda: slot_cells(sched, busy),
        lambda: erase_slot(sched, busy),
        lambda: restore_slot(sched, busy, np.arange(1, 5)),
    ):
        with pytest.raises(SlotError) as e:
            op()
        assert e.value.status == 409
    # no room: the running sequence's cells are never taken
    used = sched.memory.num_used
    free_sid = next(i for i in range(4) if i != busy)
    with pytest.raises(SlotError) as e:
        restore_slot(sched, free_sid, np.arange(1, 251, dtype=np.int64))
    assert e.value.status == 400 and "context" in str(e.value)
    with pytest.raises(SlotError) as e:
        restore_slot(sched, free_sid, np.arange(1, 170, dtype=np.int64))
    assert e.value.status == 503
    assert sched.memory.num_used == used and free_sid not in sched.prefix
    sched.memory.check()
    assert sched.seq_ids.claim(free_sid)  # the id went back to the free list
    sched.seq_ids.release(free_sid)


@pytest.mark.parametrize("kind", ["recurrent", "hybrid"])
def test_a_restored_state_takes_no_checkpoint_and_no_zeroing_copy(kind: str) -> None:
    """The restored tail is written from the file: a checkpoint of the restore's chunks would
    hold a state nobody computed, a pending zeroing copy would wipe the written one at the
    next step."""
    sched, worker = make(kind, n_batch=16)
    out = run(sched, worker, [request("a", PROMPT)])
    (sid,) = sched.prefix.seq_ids
    tokens, rows = save(sched, worker, sid)
    recr = sched.memory if kind == "recurrent" else sched.memory.recr  # type: ignore[attr-defined]
    ckpts = sum(len(c) for c in recr.slots.ckpts)
    target = (sid + 1) % 4
    restore(sched, worker, target, tokens, rows)
    assert sum(len(c) for c in recr.slots.ckpts) == ckpts  # none for the restored slot
    assert recr.slots.ckpts[target] == {}
    pending = sched.memory.take_pending()
    state_groups = [g for g in range(len(pending)) if is_state(sched, g)]
    assert all(pending[g].copy_dst.size == 0 for g in state_groups)
    sched.memory.check()
    conversation = PROMPT + out.tokens[("a", 0)]
    follow = request("b", conversation + make_prompt(5, seed=1), max_tokens=4)
    assert (
        run(sched, worker, [follow]).tokens[("b", 0)]
        == reference_output(follow, 400, windows=SPECS[kind][1])[0]
    )


def test_a_state_saved_at_another_length_is_not_a_slot() -> None:
    """A recurrent holder whose state is not after its whole length saves only the length it
    has a state for."""
    sched, worker = make("recurrent")
    run(sched, worker, [request("a", PROMPT)])
    (sid,) = sched.prefix.seq_ids
    n = int(sched.prefix.tokens(sid).shape[0])
    assert slot_cells(sched, sid).tokens.shape[0] == n
    holder = sched.prefix._holders[sid]  # the engine never makes one: the save path's guard
    holder.tokens = np.concatenate([holder.tokens, np.arange(3, dtype=np.int64)])
    held = slot_cells(sched, sid)
    assert held.tokens.shape[0] == n and held.positions[0].tolist() == [n - 1]
