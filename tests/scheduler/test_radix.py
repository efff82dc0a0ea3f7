"""The prefix index over held cells (scheduler/radix.py): many more conversations than seq ids,
one stored copy of a shared prefix, leaf-first LRU eviction under pressure, no cell leaked."""

from __future__ import annotations

import numpy as np

from kvcache.spec import Attention, MemorySpec
from kvcache.unified import UnifiedMemory
from scheduler.radix import RadixCache
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.scheduler.fakes import make_prompt, make_request, make_scheduler, reference_output, run


def held_cells_match_the_tree(sched: Scheduler) -> None:
    radix = sched.seq_ids.radix
    assert radix is not None
    tree = np.sort(radix.held())
    assert np.unique(tree).size == tree.size, "a cell in two nodes"
    assert (tree == np.flatnonzero(sched.memory.pools[0].cells.held)).all()  # type: ignore[attr-defined]
    assert radix.num_cells == tree.size


def continuation(first: Request, answer: list[int], seed: int) -> Request:
    req = make_request(first.req_id + "+", max_tokens=4)
    req.prompt_ids = list(first.prompt_ids) + answer + make_prompt(5, seed)
    return req


def test_a_hundred_conversations_with_four_seq_ids_all_continue_from_the_cache() -> None:
    sched, worker = make_scheduler(n_cells=6000, n_seq_max=4, n_ctx_seq=128, n_batch=128)
    firsts = [make_request(f"c{i}", prompt_len=30, max_tokens=4, seed=i) for i in range(120)]
    answers = {}
    for req in firsts:
        answers[req.req_id] = run(sched, worker, [req]).tokens[(req.req_id, 0)]
    assert len(sched.prefix) <= 4
    held_cells_match_the_tree(sched)

    for i, req in enumerate(firsts):
        follow = continuation(req, answers[req.req_id], seed=1000 + i)
        out = run(sched, worker, [follow])
        history = len(req.prompt_ids) + len(answers[req.req_id])
        assert out.finish[(follow.req_id, 0)].num_cached_tokens >= 0.9 * history
        assert out.tokens[(follow.req_id, 0)] == reference_output(follow, 128)[0]
    held_cells_match_the_tree(sched)


def test_a_shared_system_prompt_is_stored_once_and_leaves_are_evicted_first() -> None:
    system = make_prompt(60, seed=7)
    sched, worker = make_scheduler(n_cells=400, n_seq_max=3, n_ctx_seq=128, n_batch=64)
    outs = {}
    for i in range(40):
        req = make_request(f"q{i}", max_tokens=3)
        req.prompt_ids = system + make_prompt(15, seed=100 + i)
        outs[i] = run(sched, worker, [req])
        assert outs[i].tokens[(f"q{i}", 0)] == reference_output(req, 128)[0]
        if i:  # every later request found the system prompt
            assert outs[i].finish[(f"q{i}", 0)].num_cached_tokens >= 60
        held_cells_match_the_tree(sched)
        assert sched.memory.num_used <= 400
    radix = sched.seq_ids.radix
    assert radix is not None
    # the cache is full of leaves (17 cells each); the system prompt is one node, still there
    tops = [n for n in radix.nodes() if n.start == 0]
    assert len(tops) == 1 and tops[0].tokens.shape[0] == 60
    assert radix.match(np.asarray(system + make_prompt(15, seed=100 + 39))).length >= 60
    assert radix.match(np.asarray(system + make_prompt(15, seed=100))).length == 60  # evicted
    sched.clear_prefix_cache()
    assert sched.memory.num_used == 0 and radix.num_nodes == 0


def make_radix(n_cells: int = 64) -> tuple[UnifiedMemory, RadixCache]:
    memory = UnifiedMemory(MemorySpec.of([Attention(1, 4)]), n_cells, 2)
    return memory, RadixCache(memory)


def fill(memory: UnifiedMemory, seq: int, tokens: list[int]) -> np.ndarray:
    """seq holds len(tokens) fresh cells at positions 0.., -> those cells."""
    pos = np.arange(len(tokens))
    plan = memory.plan(pos, np.full(len(tokens), seq))
    assert plan is not None
    memory.apply(plan)
    return plan.cells[0]


def test_radix_splits_edges_matches_prefixes_and_evicts_lru_leaves() -> None:
    memory, radix = make_radix()
    a, b = [1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9]
    cells_a = fill(memory, 0, a)
    assert radix.insert(np.asarray(a), cells_a) == 5
    memory.seq_rm(0, -1, -1)
    memory.check()
    assert memory.num_used == 5  # held, no seq id
    cells_b = fill(memory, 1, b)
    assert radix.insert(np.asarray(b), cells_b) == 3  # [1, 2, 3] is the tree's already
    memory.seq_rm(1, -1, -1)
    memory.check()
    assert memory.num_used == 8 and radix.num_nodes == 3  # [1 2 3] -> [4 5] | [9 9 9]
    m = radix.match(np.asarray([1, 2, 3, 9, 9, 7]))
    assert m.length == 5
    assert (m.cells == np.concatenate([cells_a[:3], cells_b[3:5]])).all()
    radix.touch(radix.match(np.asarray(a)).node)  # a is now the most recent
    assert radix.evict_lru()  # b's leaf, the least recently used
    assert radix.match(np.asarray(b)).length == 3
    memory.check()
    assert memory.num_used == 5
    node_a = radix.match(np.asarray(a)).node
    radix.lock(node_a)
    assert not radix.evict_lru()  # a's leaf and its parent are locked
    radix.lock(node_a, -1)
    assert radix.evict_lru() and radix.evict_lru() and not radix.evict_lru()
    memory.check()
    assert memory.num_used == 0


def test_lora_keys_have_their_own_trees() -> None:
    memory, radix = make_radix()
    tokens = [5, 6, 7]
    radix.insert(np.asarray(tokens), fill(memory, 0, tokens), lora=((0, 1.0),))
    memory.seq_rm(0, -1, -1)
    assert radix.match(np.asarray(tokens)).length == 0
    assert radix.match(np.asarray(tokens), lora=((0, 1.0),)).length == 3


def test_kv_events_keep_a_demoted_prefix_and_remove_what_is_evicted() -> None:
    from scheduler.kv_blocks import BlockLedger
    from tests.scheduler.test_kv_blocks import replay

    sched, worker = make_scheduler(n_cells=300, n_seq_max=2, n_ctx_seq=128, n_batch=64)
    radix = sched.seq_ids.radix
    assert radix is not None
    ledger = BlockLedger(block_size=4)
    sched.prefix.ledger = ledger
    radix.announce(ledger)
    system, live = make_prompt(24, seed=3), set[int]()
    for i in range(20):
        req = make_request(f"k{i}", max_tokens=2)
        req.prompt_ids = system + make_prompt(30, seed=200 + i)
        run(sched, worker, [req])
        live = replay(ledger.take(), live)
        kept = [sched.prefix.tokens(s) for s in sched.prefix.seq_ids]
        kept += [radix.path_tokens(n) for n in radix.nodes()]
        assert live == {h for t in kept for h, _, _ in ledger.chain(t)} == ledger.blocks
    assert radix.num_nodes > 2  # demoted, and some evicted under pressure (300 cells)
    sched.clear_prefix_cache()
    assert replay(ledger.take(), live) == set()


def test_stats_count_the_index_and_its_cells_as_free_for_the_usage_ratio() -> None:
    from scheduler.snapshot import engine_stats

    sched, worker = make_scheduler(n_cells=400, n_seq_max=2, n_ctx_seq=128)
    for i in range(6):
        run(sched, worker, [make_request(f"s{i}", prompt_len=30, max_tokens=3, seed=i)])
    stats = engine_stats(sched, alive=True, draining=False)
    radix = sched.seq_ids.radix
    assert radix is not None and stats.prefix_index_nodes == radix.num_nodes >= 4
    assert stats.prefix_index_cells == radix.num_cells
    assert 0 < stats.cells_index_only <= radix.num_cells  # a holder may share some
    kv = sched.memory.pools[0].cells
    holders = np.unique(np.concatenate([kv.seq_cells(s)[0] for s in sched.prefix.seq_ids]))
    assert stats.cells_used == stats.cells_index_only + holders.size
    assert stats.cache_usage == holders.size / 400
