"""The scheduler against the real worker on a tiny random Llama (tests.tiny_models)."""

from __future__ import annotations

from pathlib import Path

import pytest

from model.load.loader import LoadedModel, load_model
from model.runner.worker import make_worker
from scheduler.plan import SamplingParams
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.scheduler.fakes import Outcome, make_config, make_prompt, step
from tests.tiny_models import write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(write_tiny_llama(Path(tmp_path_factory.mktemp("tiny"))))


def request(req_id: str, prompt: list[int], max_tokens: int, **kw: object) -> Request:
    kw.setdefault("sampling", SamplingParams(temperature=0.0))
    return Request(req_id, prompt, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


def serve(
    tiny: LoadedModel, batches: list[list[Request]], **cfg: object
) -> tuple[Outcome, Scheduler]:
    """Runs each batch of requests to completion, one batch after the other, on one cache."""
    config = make_config(**cfg)
    sched = Scheduler(config)
    worker = make_worker(tiny, config.n_cells)
    outcome = Outcome()
    for batch in batches:
        for r in batch:
            sched.add_request(r)
        while sched.has_work:
            step(sched, worker, outcome)  # type: ignore[arg-type]
    return outcome, sched


def test_prefix_cache_hit_gives_the_cold_output(tiny: LoadedModel) -> None:
    system = make_prompt(120, seed=1)
    first = request("a", system + make_prompt(8, seed=2), 10)
    second = request("b", system + make_prompt(8, seed=3), 16)
    warm, sched = serve(tiny, [[first], [second]], n_cells=512, n_ctx_seq=256, n_batch=64)
    assert warm.finish[("b", 0)].num_cached_tokens == 120
    cold, _ = serve(tiny, [[second]], n_cells=512, n_ctx_seq=256, n_batch=64, prefix_cache=False)
    assert warm.tokens[("b", 0)] == cold.tokens[("b", 0)]


def test_shift_over_shared_cells_equals_shift_over_private_cells(tiny: LoadedModel) -> None:
    # the same request shifts 3 times, once over cells it shares with a prefix holder
    # (copy-on-write before the K re-rotation) and once over cells of its own
    system = make_prompt(20, seed=4)
    warmup = request("w", system + [5], 2)
    probe = request("p", system + [9, 10], 60, n_keep=4)
    cfg: dict[str, object] = dict(n_cells=128, n_ctx_seq=32, n_batch=32)
    shared, s_sched = serve(tiny, [[warmup], [probe]], **cfg)
    private, p_sched = serve(tiny, [[probe]], prefix_cache=False, **cfg)
    assert shared.finish[("p", 0)].num_cached_tokens == 20
    assert s_sched.counters.num_context_shifts == p_sched.counters.num_context_shifts >= 3
    assert shared.tokens[("p", 0)] == private.tokens[("p", 0)]


def test_preemption_keeps_greedy_and_seeded_outputs(tiny: LoadedModel) -> None:
    def workload() -> list[Request]:
        reqs = [request(f"g{i}", make_prompt(12 + i, seed=i), 20) for i in range(4)]
        seeded = SamplingParams(temperature=0.9, seed=7)
        reqs.append(request("s", make_prompt(10, seed=9), 20, n=2, sampling=seeded))
        return reqs

    tight, t_sched = serve(tiny, [workload()], n_cells=48, n_ctx_seq=40, prefix_cache=False)
    roomy, r_sched = serve(tiny, [workload()], n_cells=512, n_ctx_seq=40, prefix_cache=False)
    assert t_sched.counters.num_preemptions > 0 and r_sched.counters.num_preemptions == 0
    assert tight.tokens == roomy.tokens


def test_a_burst_with_one_new_system_prompt_computes_it_once(tiny: LoadedModel) -> None:
    system = make_prompt(400, seed=11)
    burst = [request(f"q{i}", system + [1 + i] + make_prompt(19, seed=i), 6) for i in range(6)]
    cfg: dict[str, object] = dict(n_cells=4096, n_ctx_seq=1024, n_batch=128)
    warm, sched = serve(tiny, [burst], **cfg)
    cold, cold_sched = serve(tiny, [burst], prefix_cache=False, **cfg)
    assert sched.counters.num_prompt_tokens == 420 + 5 * 20
    assert cold_sched.counters.num_prompt_tokens == 6 * 420
    assert sched.counters.prefix_running_hit_tokens == 5 * 400
    assert warm.tokens == cold.tokens


def test_conversations_past_the_seq_ids_continue_from_held_cells(tiny: LoadedModel) -> None:
    # 2 seq ids, 8 conversations: the continuations take their history from the prefix
    # index over held cells (scheduler/radix.py), a context shift copies held cells first
    firsts = [request(f"c{i}", make_prompt(20, seed=50 + i), 4) for i in range(8)]
    cfg: dict[str, object] = dict(n_cells=512, n_seq_max=2, n_ctx_seq=48, n_batch=64)
    first, _ = serve(tiny, [firsts], **cfg)
    follows = [
        request(f"f{i}", r.prompt_ids + first.tokens[(r.req_id, 0)] + [7, 8], 24, n_keep=4)
        for i, r in enumerate(firsts)
    ]
    warm, sched = serve(tiny, [firsts] + [[f] for f in follows], **cfg)
    cold, _ = serve(tiny, [[f] for f in follows], prefix_cache=False, **cfg)
    for f in follows:
        assert warm.finish[(f.req_id, 0)].num_cached_tokens >= 0.9 * 24
        assert warm.tokens[(f.req_id, 0)] == cold.tokens[(f.req_id, 0)]
    assert sched.counters.num_context_shifts > 0
