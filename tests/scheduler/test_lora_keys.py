"""LoRA selections in the scheduler (no model): plans carry each sequence's adapters, the
prefix cache and running-prefix sharing never cross them, KV events name them, and the
stats list the adapters of running and waiting requests."""

from __future__ import annotations

import numpy as np

from scheduler.kv_blocks import BlockLedger, BlockRemoved, BlockStored
from scheduler.plan import LoraKey
from scheduler.prefix_cache import uses_adapter
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from scheduler.snapshot import engine_stats
from tests.scheduler.fakes import FakeWorker, Outcome, make_config, make_prompt, make_request, step

PIRATE: LoraKey = ((0, 1.0),)
MIX: LoraKey = ((0, 0.5), (2, 1.0))


def lora_request(req_id: str, prompt: list[int], lora: LoraKey, name: str | None = None) -> Request:
    req = make_request(req_id, max_tokens=3)
    req.prompt_ids = list(prompt)
    req.lora, req.lora_name = lora, name
    return req


def run(
    sched: Scheduler, batches: list[list[Request]], worker: FakeWorker | None = None
) -> Outcome:
    """`worker`: the one that holds the cache's K/V when `sched` ran before."""
    worker, outcome = worker or FakeWorker(sched.config.n_cells), Outcome()
    for batch in batches:
        for r in batch:
            sched.add_request(r)
        while sched.has_work:
            plan = step(sched, worker, outcome)
            running = {s.seq_id: s.request.lora for s in sched.running}
            for sb in plan.seqs:  # every sequence's rows carry its request's adapters
                assert sb.lora == running.get(sb.seq_id, sb.lora)
    return outcome


def test_prefix_cache_and_events_are_per_adapter() -> None:
    sched = Scheduler(make_config(n_cells=512, n_batch=64))
    sched.prefix.ledger = BlockLedger(block_size=8)
    system = make_prompt(32, seed=1)
    out = run(
        sched,
        [
            [lora_request("a", system + [3], PIRATE, "pirate")],
            [lora_request("b", system + [4], ())],
            [lora_request("c", system + [5], MIX, "pirate*0.5+poet")],
            [lora_request("d", system + [6], PIRATE, "pirate")],
        ],
    )
    cached = {r: out.finish[(r, 0)].num_cached_tokens for r in "abcd"}
    assert cached == {"a": 0, "b": 0, "c": 0, "d": 32}
    stored = [e for e in sched.prefix.ledger.take() if isinstance(e, BlockStored)]
    first = {(e.lora_id, e.lora_name) for e in stored if e.parent_block_hash is None}
    assert (None, None) in first and (1, "pirate") in first
    assert any(name == "pirate*0.5+poet" and lid not in (None, 1) for lid, name in first)


def test_a_waiter_never_waits_for_another_adapters_prompt() -> None:
    """A long prompt being computed under one adapter: a queued request with the same prompt
    waits for it only under the same adapter (under another it would never get the prefix)."""
    sched = Scheduler(make_config(n_cells=1024, n_batch=32, n_ctx_seq=512, prefix_wait_min=16))
    system = make_prompt(200, seed=2)
    worker, outcome = FakeWorker(1024), Outcome()
    sched.add_request(lora_request("reader", system + [1], PIRATE))
    step(sched, worker, outcome)
    sched.add_request(lora_request("base", system + [2], ()))
    sched.add_request(lora_request("same", system + [3], PIRATE))
    queued = {s.req_id: s for s in sched.waiting}
    pending = {r: sched.sharing.pending(s, sched.running) for r, s in queued.items()}
    assert pending == {"base": 0, "same": 200}
    stats = engine_stats(sched, alive=True, draining=False)
    assert stats.running_lora_ids == (0,) and stats.waiting_lora_ids == (0,)
    while sched.has_work:
        step(sched, worker, outcome)
    assert outcome.finish[("same", 0)].num_cached_tokens == 200
    assert outcome.finish[("base", 0)].num_cached_tokens == 0


def test_dropping_an_adapters_cache_frees_its_holders_and_index_and_nothing_else() -> None:
    """An unloaded adapter's id is never selected again: what the prefix cache keeps under it
    (holders and prefix-index trees, alone or in a mix) is freed at once; the base model's
    and other adapters' entries stay and still hit."""
    sched = Scheduler(make_config(n_cells=2048, n_seq_max=3, n_batch=64))
    ledger = BlockLedger(block_size=8)
    sched.prefix.ledger = ledger
    radix = sched.seq_ids.radix
    assert radix is not None
    radix.announce(ledger)
    system = make_prompt(32, seed=3)
    keys: list[tuple[str, LoraKey]] = [("p", PIRATE), ("b", ()), ("x", MIX), ("q", ((1, 1.0),))]
    # more conversations than seq ids: the older ones are demoted into the prefix index
    worker = FakeWorker(sched.config.n_cells)
    batches = [[lora_request(f"{n}{i}", system + [i], k)] for i in range(3) for n, k in keys]
    run(sched, batches, worker)
    assert any(uses_adapter(sched.prefix.lora(s), 0) for s in sched.prefix.seq_ids)
    assert any(uses_adapter(n.lora, 0) for n in radix.nodes())
    kept = {
        (n.lora, tuple(radix.path_tokens(n))) for n in radix.nodes() if not uses_adapter(n.lora, 0)
    }
    ledger.take()

    sched.drop_adapter_cache(0)

    sched.memory.check()
    assert not any(uses_adapter(sched.prefix.lora(s), 0) for s in sched.prefix.seq_ids)
    assert {(n.lora, tuple(radix.path_tokens(n))) for n in radix.nodes()} == kept
    kv = sched.memory.pools[0].cells  # type: ignore[attr-defined]
    assert (np.sort(radix.held()) == np.flatnonzero(kv.held)).all()
    assert radix.num_cells == radix.held().size
    owned = [kv.seq_cells(s)[0] for s in sched.prefix.seq_ids] + [radix.held()]
    assert sched.memory.num_used == np.unique(np.concatenate(owned)).size  # nothing else
    assert any(isinstance(e, BlockRemoved) for e in ledger.take())
    out = run(
        sched,
        [
            [lora_request("p9", system + [9], PIRATE)],
            [lora_request("b9", system + [9], ())],
            [lora_request("q9", system + [9], ((1, 1.0),))],
        ],
        worker,
    )
    cached = {r: out.finish[(r, 0)].num_cached_tokens for r in ("p9", "b9", "q9")}
    assert cached == {"p9": 0, "b9": 32, "q9": 32}
