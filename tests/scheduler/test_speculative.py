"""Speculative decoding (scheduler/speculative.py) against the checking fake worker: drafted
rows, verification, rollback of the rejected drafts' cells, and output identical to decoding
without speculation (greedy and seeded), through preemption, context shift and n > 1."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from scheduler.plan import SampleRow, SamplingParams
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from scheduler.speculative import SpecConfig, accepted_count, ngram_propose, parse_spec_type
from tests.scheduler.fakes import (
    VOCAB,
    FakeWorker,
    Outcome,
    make_config,
    make_request,
    next_token,
    reference_output,
    step,
)

PERIOD = 7


def periodic(contexts: list[np.ndarray], sample: SampleRow, hashes: tuple[int, ...] = ()) -> int:
    """A model that repeats its context with period 7 (the fake's hash before that), plus the
    (seed, output_index) draw when sampling: n-gram drafts are accepted where it is greedy."""
    ctx = np.asarray(contexts[0])
    if ctx.size < PERIOD:
        return next_token(contexts, sample, hashes)
    token = int(ctx[-PERIOD])
    if sample.params.temperature > 0:
        rng = np.random.default_rng(sample.seed * 1_000_003 + sample.output_index)
        if rng.random() < 0.3:  # a third of the draws leave the pattern
            token = int(rng.integers(VOCAB))
    return token


def serve(
    requests_fn: Callable[[], list[Request]],
    spec: str,
    model: Callable[..., int] | None = None,
    spec_kw: dict[str, int] | None = None,
    **cfg: object,
) -> tuple[Outcome, Scheduler]:
    """Every request of requests_fn() to completion; every step checked (fakes.step), and
    no cell left behind once the prefix cache lets go."""
    config = make_config(spec=SpecConfig(kind=spec, **(spec_kw or {})), **cfg)  # type: ignore[arg-type]
    sched = Scheduler(config)
    worker = FakeWorker(config.n_cells, model=model)
    outcome = Outcome()
    for r in requests_fn():
        sched.add_request(r)
    while sched.has_work:
        step(sched, worker, outcome)
        assert outcome.num_steps < 5000
    sched.clear_prefix_cache()
    assert all(p.cells.stats().used == 0 for p in sched.memory.pools)
    assert sched.num_free_seq_ids == config.n_seq_max
    return outcome, sched


def test_ngram_propose_takes_the_latest_longest_match() -> None:
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert ngram_propose(ctx, 2, 4, 3) == [4, 5, 6]  # latest "1 2 3" with a continuation
    assert ngram_propose(ctx, 2, 4, 10) == [4, 5, 6, 1, 2, 3]
    assert ngram_propose([5, 6, 7, 8], 1, 3, 4) == []  # nothing repeats
    assert ngram_propose([7], 1, 3, 4) == []
    # a longer n-gram wins over a later shorter one
    assert ngram_propose([1, 2, 10, 5, 2, 11, 1, 2], 1, 2, 1) == [10]
    assert ngram_propose([1, 2, 10, 5, 2, 11, 1, 2], 1, 1, 1) == [11]
    assert accepted_count([4, 5, 6], [4, 5, 0, 1]) == 2
    assert accepted_count([4], [3, 4]) == 0


def test_spec_types_parse_as_llama_cpps_list() -> None:
    assert parse_spec_type("ngram-simple,draft-simple", False) == "ngram,draft"
    assert parse_spec_type("ngram", True) == "ngram,draft"  # the draft model joins in
    assert parse_spec_type("ngram", False) == "ngram"
    assert parse_spec_type("draft-simple", True) == "draft"
    assert parse_spec_type("none", True) == "none"
    for bad in ("eagle", "none,ngram", "ngram,,mtp"):
        with pytest.raises(ValueError):
            parse_spec_type(bad, True)


class PeriodicDrafter:
    """A draft model that knows the periodic pattern (so its drafts are right where the
    target is greedy); records the contexts it was asked for."""

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def propose(self, asks: list[tuple[int, list[int], int]], live: set[int]) -> list[list[int]]:
        out = []
        for _, tokens, k in asks:
            self.asked.append(list(tokens))
            ctx = list(tokens)
            for _ in range(k):
                ctx.append(ctx[-PERIOD] if len(ctx) >= PERIOD else 0)
            out.append(ctx[len(tokens) :])
        return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_lookup_goes_first_and_the_draft_model_takes_the_rest(temperature: float) -> None:
    plain, _ = serve(_workload(temperature), "none", periodic)
    drafter = PeriodicDrafter()
    config = make_config(spec=SpecConfig(kind="ngram,draft", draft_seqs_max=8))
    sched = Scheduler(config, drafter=drafter)
    worker, spec = FakeWorker(config.n_cells, model=periodic), Outcome()
    for r in _workload(temperature)():
        sched.add_request(r)
    while sched.has_work:
        step(sched, worker, spec)
    assert spec.tokens == plain.tokens
    by = sched.spec.stats.by_source
    assert by["ngram"][0] > 0 and by["draft"][0] > 0  # both proposed...
    assert by["ngram"][1] > 0 and by["draft"][1] > 0  # ...and both were right sometimes
    assert sum(v[0] for v in by.values()) == sched.spec.stats.num_draft_tokens
    c = config.spec
    # the draft model is asked where the lookup has nothing; greedy, no lookup round misses,
    # so the lookup never sits out and that is the only case
    missing = [ctx for ctx in drafter.asked if not ngram_propose(ctx, c.ngram_min, c.ngram_max, 1)]
    assert missing and (missing == drafter.asked or temperature > 0)


def _workload(temperature: float = 0.0, n: int = 1, **kw: object) -> Callable[[], list[Request]]:
    def make() -> list[Request]:
        sampling = SamplingParams(temperature=temperature, seed=11 if temperature else None)
        return [
            make_request(
                f"r{i}", prompt_len=10 + 3 * i, max_tokens=40, seed=i, n=n, sampling=sampling, **kw
            )
            for i in range(3)
        ]

    return make


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculation_gives_the_same_tokens_in_fewer_steps(temperature: float) -> None:
    plain, _ = serve(_workload(temperature), "none", periodic)
    spec, sched = serve(_workload(temperature), "ngram", periodic)
    assert spec.tokens == plain.tokens
    stats = sched.spec.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert stats.num_emitted_tokens == stats.num_accepted_tokens + stats.num_drafts
    assert sum(stats.acceptance_lengths) == stats.num_drafts
    assert spec.num_steps < plain.num_steps
    if temperature == 0.0:  # the pattern is kept: most drafts are right
        assert stats.num_accepted_tokens > 0.8 * stats.num_draft_tokens
    else:  # and some are not: the rollback ran
        assert stats.num_accepted_tokens < stats.num_draft_tokens


def test_rejected_drafts_are_rolled_back_exactly() -> None:
    # the fake's hash model rarely repeats: most drafts are rejected, and the output is the
    # cache-free reference's token for token (a kept rejected cell would change the hash)
    def make() -> list[Request]:
        return [make_request(f"h{i}", prompt_len=30, max_tokens=60, seed=i) for i in range(3)]

    out, sched = serve(make, "ngram", spec_kw=dict(ngram_min=1), n_ctx_seq=256)
    for req in make():
        assert out.tokens[(req.req_id, 0)] == reference_output(req, 256)[0]
    stats = sched.spec.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens
    # rounds that accepted nothing make their sequence sit out steps: far fewer rounds than
    # the 180 decode rows
    assert stats.acceptance_lengths[0] > 0 and stats.num_drafts < 60


def test_through_preemption_context_shift_and_forks() -> None:
    make = _workload(0.8, n=2, n_keep=4)
    tight_cfg: dict[str, object] = dict(n_cells=72, n_ctx_seq=32, prefix_cache=False)
    plain, p_sched = serve(make, "none", periodic, **tight_cfg)
    spec, s_sched = serve(make, "ngram", periodic, **tight_cfg)
    assert spec.tokens == plain.tokens
    assert s_sched.counters.num_context_shifts > 0 and s_sched.counters.num_preemptions > 0
    assert s_sched.spec.stats.num_accepted_tokens > 0


def test_stop_token_inside_the_accepted_drafts_ends_there() -> None:
    # the periodic pattern holds the stop id: the request stops at its first occurrence even
    # when it comes in the middle of a verified draft, and nothing of it stays in the cache
    def make() -> list[Request]:
        r = make_request("s", prompt_len=12, max_tokens=60, seed=3, ignore_eos=False)
        r.prompt_ids[5] = 0  # STOP_ID
        return [r]

    plain, _ = serve(make, "none", periodic, prefix_cache=False)
    spec, sched = serve(make, "ngram", periodic, prefix_cache=False)
    assert spec.tokens == plain.tokens and spec.finish[("s", 0)].reason == "stop"
    assert sched.memory.pools[0].cells.stats().used == 0


def test_no_drafts_under_load_or_when_the_request_opts_out() -> None:
    busy = lambda: [make_request(f"b{i}", 10, 30, seed=i) for i in range(20)]  # noqa: E731
    _, sched = serve(busy, "ngram", periodic, n_seq_max=24, n_cells=2048, n_batch=256)
    early = sched.spec.stats.num_drafts  # drafts happen only once few sequences are left
    assert early < 20 * 30 / 4
    opt_out = lambda: [make_request("o", 10, 40, draft_max=0)]  # noqa: E731
    _, sched = serve(opt_out, "ngram", periodic)
    assert sched.spec.stats.num_drafts == 0


def test_sliding_window_memory_rolls_back_too() -> None:
    # the fake worker checks that every row sees exactly its window after each rollback
    from kvcache.spec import Attention, MemorySpec

    spec = MemorySpec.of([Attention(2, 8), Attention(2, 8, window=8)])
    plain, _ = serve(_workload(0.8), "none", periodic, memory_spec=spec, memory="iswa")
    out, sched = serve(_workload(0.8), "ngram", periodic, memory_spec=spec, memory="iswa")
    assert sched.spec.enabled and out.tokens == plain.tokens
    assert 0 < sched.spec.stats.num_accepted_tokens < sched.spec.stats.num_draft_tokens


RECURRENT = [((3, 8), (2, 4, 4))]  # a conv and an SSM state per slot


def periodic_state(
    contexts: list[np.ndarray], sample: SampleRow, hashes: tuple[int, ...] = ()
) -> int:
    """periodic, except where the recurrent state's hash says otherwise (a quarter of the
    rows): a state that consumed the wrong tokens changes the output."""
    if hashes and hashes[0] % 4 == 0:
        return next_token([], sample, hashes)
    return periodic(contexts, sample, hashes)


def _recurrent_spec(hybrid: bool):  # type: ignore[no-untyped-def]
    from kvcache.spec import Attention, MemorySpec, Recurrent

    layers = [Recurrent(*RECURRENT)] + ([Attention(2, 8)] if hybrid else [])
    return MemorySpec.of(layers)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_hybrid_memories_roll_back_to_a_checkpoint(temperature: float) -> None:
    # the fake's state is a hash of every token consumed: a state rolled back to the wrong
    # checkpoint, or left past the rejected drafts, changes every later token
    spec = _recurrent_spec(hybrid=True)
    plain, _ = serve(_workload(temperature), "none", periodic_state, memory_spec=spec)
    out, sched = serve(_workload(temperature), "ngram", periodic_state, memory_spec=spec)
    assert sched.spec.enabled and out.tokens == plain.tokens
    stats = sched.spec.stats
    assert stats.num_accepted_tokens > 0 and out.num_steps < plain.num_steps
    if temperature > 0:
        assert stats.num_accepted_tokens < stats.num_draft_tokens  # rollbacks ran


def test_recurrent_memories_roll_back_to_a_checkpoint() -> None:
    # a state alone: the fake's tokens come from the hash of everything consumed, so most
    # drafts are rejected, and the output is still the cache-free reference's
    def make() -> list[Request]:
        return [make_request(f"h{i}", prompt_len=30, max_tokens=60, seed=i) for i in range(3)]

    spec = _recurrent_spec(hybrid=False)
    kw: dict[str, object] = dict(spec_kw=dict(ngram_min=1), n_ctx_seq=256, memory_spec=spec)
    out, sched = serve(make, "ngram", **kw)  # type: ignore[arg-type]
    plain, _ = serve(make, "none", **kw)  # type: ignore[arg-type]
    assert sched.spec.enabled and out.tokens == plain.tokens
    stats = sched.spec.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > stats.num_accepted_tokens


def test_recurrent_drafts_stay_within_the_checkpoint_slots() -> None:
    spec = _recurrent_spec(hybrid=True)
    plain, _ = serve(_workload(), "none", periodic, memory_spec=spec)
    out, sched = serve(_workload(), "ngram", periodic, memory_spec=spec, state_checkpoints=2)
    assert sched.memory.rollback_rows == 2 and out.tokens == plain.tokens
    stats = sched.spec.stats
    assert stats.num_accepted_tokens > 0 and not any(stats.accepted_per_pos[2:])
    _, sched = serve(_workload(), "ngram", periodic, memory_spec=spec, state_checkpoints=0)
    assert not sched.spec.enabled and sched.spec.snapshot() is None


def test_a_recurrent_stop_inside_the_accepted_drafts_cuts_the_state_there() -> None:
    # a prompt that repeats a period holding the stop id: the first verification accepts
    # drafts past the stop, and retiring the sequence rolls its state back to the stop
    def make() -> list[Request]:
        r = make_request("s", prompt_len=12, max_tokens=60, seed=3, ignore_eos=False)
        period = list(r.prompt_ids[:PERIOD])
        period[3] = 0  # STOP_ID
        r.prompt_ids = period * 2
        return [r]

    spec = _recurrent_spec(hybrid=True)
    plain, _ = serve(make, "none", periodic, memory_spec=spec)
    out, sched = serve(make, "ngram", periodic, memory_spec=spec)
    assert out.tokens == plain.tokens and out.finish[("s", 0)].reason == "stop"
    # o0 from the prompt step; the stop is the sample of the third drafted row
    assert len(out.tokens[("s", 0)]) == 3 and sched.spec.stats.num_accepted_tokens >= 3
