"""KV events of running sequences (scheduler/kv_blocks.py, Sharing.announce): a computed block
is stored in the step that computed it, passes to the holder a finish makes without a second
BlockStored, and is removed only when no running sequence and no cache holder keeps it. After
every step, stored - removed = the blocks of holders, index nodes and running sequences."""

from __future__ import annotations

import random

from scheduler.context_shift import clamp_n_keep
from scheduler.kv_blocks import AllBlocksCleared, BlockLedger, BlockRemoved, BlockStored
from scheduler.plan import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.sequence import SeqState
from tests.scheduler.fakes import FakeWorker, Outcome, make_request, make_scheduler, step
from tests.scheduler.test_kv_blocks import replay

BLOCK = 4


def with_ledger(**kw: object) -> tuple[Scheduler, FakeWorker]:
    sched, worker = make_scheduler(**kw)
    sched.prefix.ledger = BlockLedger(BLOCK)
    if sched.seq_ids.radix is not None:
        sched.seq_ids.radix.announce(sched.prefix.ledger)
    return sched, worker


def running_blocks(sched: Scheduler) -> set[int]:
    """What running sequences hold at positions 0..n-1 as computed cold: their computed
    tokens, only up to n_keep once shifted."""
    ledger = sched.prefix.ledger
    assert ledger is not None
    out: set[int] = set()
    for s in sched.running:
        if s.state is not SeqState.RUNNING or s.seq_id < 0:
            continue
        n = s.num_computed
        if s.num_shifts:
            n = min(n, clamp_n_keep(s.request.n_keep, s.num_prompt, sched.config.n_ctx_seq))
        out |= {h for h, _, _ in ledger.chain(s.tokens[:n], s.request.lora)}
    return out


def cache_blocks(sched: Scheduler) -> set[int]:
    """What the prefix cache holds: holders and index nodes, not running sequences."""
    ledger, prefix, radix = sched.prefix.ledger, sched.prefix, sched.seq_ids.radix
    assert ledger is not None
    kept = [prefix.tokens(sid) for sid in prefix.seq_ids]
    kept += [radix.path_tokens(n) for n in radix.nodes()] if radix is not None else []
    return {h for t in kept for h, _, _ in ledger.chain(t)}


def held_blocks(sched: Scheduler) -> set[int]:
    return cache_blocks(sched) | running_blocks(sched)


class Checked:
    """Steps a scheduler and replays its KV events: the view must equal what is held."""

    def __init__(self, sched: Scheduler, worker: FakeWorker) -> None:
        self.sched, self.worker = sched, worker
        self.outcome = Outcome()
        self.live: set[int] = set()
        self.events: list = []

    def step(self) -> list:
        step(self.sched, self.worker, self.outcome)
        return self.take()

    def take(self) -> list:
        events = self.sched.take_kv_events()
        self.events += events
        self.live = replay(events, self.live)  # asserts no block is stored twice
        assert self.live == held_blocks(self.sched) == self.sched.prefix.ledger.blocks
        return events

    def run(self) -> None:
        while self.sched.has_work:
            self.step()


def stored(events: list) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def removed(events: list) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def test_a_prompt_is_announced_chunk_by_chunk_and_not_again_when_it_is_cached() -> None:
    sched, worker = with_ledger(n_batch=16)
    c = Checked(sched, worker)
    sched.add_request(make_request("a", prompt_len=40, max_tokens=6))
    first = c.step()
    assert len(stored(first)) == 16 // BLOCK  # the first chunk's blocks, while it runs
    c.run()
    assert sched.prefix.seq_ids, "the finished prompt is a holder"
    n = (40 + 6 - 1) // BLOCK  # its computed context: prompt + generated but the last
    assert len(stored(c.events)) == n and not removed(c.events)


def test_an_abort_passes_the_blocks_to_the_cache_and_a_reset_clears_them() -> None:
    sched, worker = with_ledger(n_batch=64)
    c = Checked(sched, worker)
    sched.add_request(make_request("a", prompt_len=30, max_tokens=50))
    for _ in range(3):
        c.step()
    assert len(c.live) >= 30 // BLOCK
    sched.abort("a")
    assert c.step() == []  # NOTE: an aborted context is cached (scheduler._finish): kept
    sched.clear_prefix_cache()
    assert c.take() == [AllBlocksCleared()]


def test_a_failed_request_that_alone_held_its_blocks_removes_them() -> None:
    sched, worker = with_ledger(n_batch=64)
    c = Checked(sched, worker)
    sched.add_request(make_request("a", prompt_len=30, max_tokens=50))
    c.step()
    held = set(c.live)
    plan = sched.schedule()
    sched.fail_seqs({plan.seqs[0].seq_id: "boom"})  # an error is never cached
    sched.update(plan, worker.execute(plan))
    assert set(removed(c.take())) >= held and c.live == set()


def test_two_requests_sharing_a_prefix_remove_it_only_when_both_are_gone() -> None:
    sched, worker = with_ledger(n_batch=64)
    c = Checked(sched, worker)
    a = make_request("a", prompt_len=33, max_tokens=50, seed=1)
    sched.add_request(a)
    for _ in range(8):  # 33 + 7 tokens computed: two blocks of its own past the shared 32
        c.step()
    b = make_request("b", max_tokens=50)
    b.prompt_ids = a.prompt_ids[:32] + [7, 8, 9, 10, 11, 12, 13, 14, 15]
    sched.add_request(b)
    c.step()
    c.step()
    assert sched.counters.prefix_running_hit_tokens >= 32  # b took them from running a
    shared = {h for h, _, _ in sched.prefix.ledger.chain(a.prompt_ids[:32])}
    assert shared <= c.live
    plan = sched.schedule()
    seq_a = next(s for s in sched.running if s.req_id == "a")
    sched.fail_seqs({seq_a.seq_id: "boom"})
    sched.update(plan, worker.execute(plan))
    gone = set(removed(c.take()))
    assert gone and not gone & shared  # a's own blocks went, the shared ones stay for b
    plan = sched.schedule()
    sched.fail_seqs({sched.running[0].seq_id: "boom"})
    sched.update(plan, worker.execute(plan))
    assert shared <= set(removed(c.take())) and c.live == set()


def test_a_context_shift_removes_the_blocks_past_n_keep() -> None:
    sched, worker = with_ledger(n_batch=64, n_ctx_seq=32, prefix_cache=True)
    c = Checked(sched, worker)
    sched.add_request(make_request("a", prompt_len=12, max_tokens=40, n_keep=8))
    while sched.counters.num_context_shifts == 0:
        c.step()
    kept = {h for h, _, _ in sched.prefix.ledger.chain(sched.running[0].tokens[:8])}
    assert c.live == kept  # nothing past n_keep is the same prefix any more
    c.run()


def test_random_load_with_preemptions_shifts_and_aborts_keeps_the_view_exact() -> None:
    rng = random.Random(5)
    sched, worker = with_ledger(n_cells=160, n_seq_max=6, n_batch=32, n_ctx_seq=48)
    c = Checked(sched, worker)
    system = [rng.randrange(1, 90) for _ in range(12)]
    for i in range(40):
        req = make_request(f"r{i}", max_tokens=rng.randint(1, 60), n_keep=rng.choice([0, 8]))
        if i % 5 == 0:  # n > 1: the choices fork the prompt's cells (seq_cp)
            req.n, req.sampling = 2, SamplingParams(temperature=0.8, seed=i)
        req.prompt_ids = system + [rng.randrange(1, 90) for _ in range(rng.randint(1, 24))]
        sched.add_request(req)
        for _ in range(rng.randint(0, 4)):
            c.step()
        if rng.random() < 0.2:
            sched.abort(f"r{rng.randrange(i + 1)}")
    c.run()
    counters = sched.counters
    assert counters.num_preemptions > 0 and counters.num_context_shifts > 0
    assert stored(c.events) and removed(c.events)
    sched.clear_prefix_cache()
    assert replay(c.take(), c.live) == set()


def test_without_prefix_caching_running_blocks_are_not_announced() -> None:
    sched, worker = with_ledger(prefix_cache=False)  # nothing can reuse them
    sched.add_request(make_request("a", prompt_len=30, max_tokens=4))
    step(sched, worker, Outcome())
    assert sched.take_kv_events() == []
