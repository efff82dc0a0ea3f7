"""The prefix index on the iSWA memory (scheduler/radix.py, kvcache/iswa.py): a demoted holder
leaves its window (the SWA cells of its last W positions) beside its full-pool cells, a match is
cut back to a length some held window covers, the windows stay within their budget, and every
output equals the cacheless reference whose window layer reads the last W tokens."""

from __future__ import annotations

import numpy as np

from kvcache.iswa import ISWAMemory
from kvcache.spec import Attention, MemorySpec
from scheduler.radix import RadixCache
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.scheduler.fakes import (
    FakeWorker,
    make_config,
    make_prompt,
    make_request,
    reference_output,
    run,
)

W = 16
SPEC = MemorySpec.of([Attention(1, 4), Attention(1, 4, W)])


def make_swa_scheduler(**kw: object) -> tuple[Scheduler, FakeWorker]:
    config = make_config(memory_spec=SPEC, **kw)
    return Scheduler(config), FakeWorker(config.n_cells)


def ref(req: Request, n_ctx_seq: int) -> list[int]:
    return reference_output(req, n_ctx_seq, 0, windows=(0, W))[0]


def index_matches_memory(sched: Scheduler) -> None:
    """What the index points at is exactly what the memory holds, in each pool."""
    radix = sched.seq_ids.radix
    assert radix is not None
    tree = np.sort(radix.held())
    assert np.unique(tree).size == tree.size == radix.num_cells
    assert (tree == np.flatnonzero(sched.memory.pools[0].cells.held)).all()  # type: ignore[attr-defined]
    for p, cells in enumerate(radix.held_windows(), start=1):
        assert (cells == np.flatnonzero(sched.memory.pools[p].cells.held)).all()  # type: ignore[attr-defined]
        assert cells.size == radix.num_window_cells[p - 1] <= radix.budget[p - 1]
    sched.memory.check()


def continuation(first: Request, answer: list[int], seed: int) -> Request:
    req = make_request(first.req_id + "+", max_tokens=4)
    req.prompt_ids = list(first.prompt_ids) + answer + make_prompt(5, seed)
    return req


def test_a_hundred_conversations_with_four_seq_ids_continue_from_the_index() -> None:
    """Conversations longer than the window: each keeps W window cells, not its length (the
    budget takes the first turns and their continuations)."""
    sched, worker = make_swa_scheduler(
        n_cells=6000, n_seq_max=4, n_ctx_seq=128, n_batch=128, swa_index_cells=240 * W
    )
    assert sched.seq_ids.radix is not None
    firsts = [make_request(f"c{i}", prompt_len=30, max_tokens=4, seed=i) for i in range(120)]
    answers = {}
    for req in firsts:
        out = run(sched, worker, [req])
        answers[req.req_id] = out.tokens[(req.req_id, 0)]
        assert answers[req.req_id] == ref(req, 128)
    assert len(sched.prefix) <= 4
    index_matches_memory(sched)
    assert sched.seq_ids.radix.num_window_cells[0] <= 116 * W  # one window each

    for i, req in enumerate(firsts):
        follow = continuation(req, answers[req.req_id], seed=1000 + i)
        out = run(sched, worker, [follow])
        history = len(req.prompt_ids) + len(answers[req.req_id])
        assert out.finish[(follow.req_id, 0)].num_cached_tokens >= history - 1
        assert out.tokens[(follow.req_id, 0)] == ref(follow, 128)
    index_matches_memory(sched)
    sched.clear_prefix_cache()
    assert sched.memory.num_used == 0


def test_the_windows_stay_within_their_budget_and_the_oldest_go_first() -> None:
    sched, worker = make_swa_scheduler(
        n_cells=6000, n_seq_max=2, n_ctx_seq=128, n_batch=128, swa_index_cells=3 * W
    )
    radix = sched.seq_ids.radix
    assert radix is not None
    firsts = [make_request(f"b{i}", prompt_len=40, max_tokens=3, seed=50 + i) for i in range(12)]
    answers = {}
    for req in firsts:
        answers[req.req_id] = run(sched, worker, [req]).tokens[(req.req_id, 0)]
        index_matches_memory(sched)
    # three windows fit: the index keeps the three most recent demoted conversations only
    assert radix.num_window_cells[0] <= 3 * W
    assert 1 <= sum(n.window is not None for n in radix.nodes()) <= 3
    hits = []
    for i, req in reversed(list(enumerate(firsts))):  # the most recent first
        follow = continuation(req, answers[req.req_id], seed=2000 + i)
        out = run(sched, worker, [follow])
        assert out.tokens[(follow.req_id, 0)] == ref(follow, 128)  # hit or miss, the same
        hits.append(out.finish[(follow.req_id, 0)].num_cached_tokens)
        index_matches_memory(sched)
    # the two holders and the index's three windows keep the five most recent, but each
    # continuation that finishes is kept too and pushes an older conversation out: the three
    # most recent continue from the cache, the oldest was evicted long before
    assert min(hits[:3]) >= 40 and hits[-1] == 0


def make_index(n_cells: int = 256, budget: int = 4 * W) -> tuple[ISWAMemory, RadixCache]:
    memory = ISWAMemory(SPEC, n_cells, 2, 64, index_cells=budget)
    return memory, RadixCache(memory)


def demote(memory: ISWAMemory, radix: RadixCache, tokens: list[int]) -> None:
    """Seq 0 computes `tokens`, then is demoted into the index (as SeqIds.demote_holder)."""
    pos = np.arange(len(tokens))
    plan = memory.plan(pos, np.zeros(len(tokens), dtype=np.int64))
    assert plan is not None
    memory.apply(plan)
    memory.seq_trim(0)  # what the next step's prune leaves it: its last W positions
    n = len(tokens)
    radix.insert(
        np.asarray(tokens), memory.seq_prefix_cells(0, n), window=memory.seq_window_cells(0, n)
    )
    memory.seq_rm(0, -1, -1)
    memory.check()


def test_a_match_is_cut_back_to_a_length_a_window_covers() -> None:
    memory, radix = make_index()
    long = list(range(100, 160))  # 60 tokens: its window covers lengths 59 and 60 only
    demote(memory, radix, long)
    assert memory.pools[1].cells.used == W  # its last W positions stay, held
    assert radix.match(np.asarray(long)).length == 60
    m = radix.match(np.asarray(long[:59] + [7]))
    assert m.length == 59 and m.windows[0].size == W - 1  # positions 44..58: all it holds
    # diverging at 50: no held window covers [35, 50), so nothing is reused
    assert radix.match(np.asarray(long[:50] + [7, 8])).length == 0

    short = list(range(100, 110)) + [1, 2]  # 12 tokens (<= W): every length of it is served
    demote(memory, radix, short)
    m = radix.match(np.asarray(short[:8] + [9, 9]))
    assert m.length == 8 and m.node is not None and m.node.window is not None
    assert m.windows[0].size == 8  # positions 0..7
    # the long conversation's shared first 10 tokens are served by the short one's window
    m = radix.match(np.asarray(long[:50] + [7]))
    assert m.length == 10 and (m.cells == radix.match(np.asarray(short)).cells[:10]).all()


def test_a_window_shared_by_two_conversations_is_held_once_and_released_last() -> None:
    memory, radix = make_index(budget=2 * W)
    a = list(range(1, 11))  # within the window: its window is all its 10 cells
    demote(memory, radix, a)
    pos = np.arange(10)
    # seq 1 continues a from the index (cells_cp of both pools), then is demoted
    m = radix.match(np.asarray(a + [50]))
    assert m.length == 10
    memory.cells_cp(m.cells, 1)
    memory.cells_cp(m.windows[0], 1, pool=1)
    plan = memory.plan(np.arange(10, 14), np.ones(4, dtype=np.int64))
    assert plan is not None
    memory.apply(plan)
    b = a + [50, 51, 52, 53]
    radix.insert(
        np.asarray(b), memory.seq_prefix_cells(1, 14), window=memory.seq_window_cells(1, 14)
    )
    memory.seq_rm(1, -1, -1)
    memory.check()
    assert radix.num_window_cells[0] == 14  # a's 10 window cells once, b's 4 new ones
    assert (memory.pools[1].cells.pos[radix.held_windows()[0]] >= 0).all()
    radix.touch(radix.match(np.asarray(a)).node)  # b is the least recently used leaf
    assert radix.evict_lru()
    assert radix.num_window_cells[0] == 10 and memory.pools[1].cells.used == 10
    assert radix.evict_lru() and not radix.evict_lru()
    assert memory.num_used == 0 and int(pos.size) == 10
