"""LoRA selections in the scheduler (no model): plans carry each sequence's adapters, the
prefix cache and running-prefix sharing never cross them, KV events name them, and the
stats list the adapters of running and waiting requests."""

from __future__ import annotations

from scheduler.kv_blocks import BlockLedger, BlockStored
from scheduler.plan import LoraKey
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


def run(sched: Scheduler, batches: list[list[Request]]) -> Outcome:
    worker, outcome = FakeWorker(sched.config.n_cells), Outcome()
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
