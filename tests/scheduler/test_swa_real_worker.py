"""The iSWA memory driving a real model: a tiny random Gemma 3 (window 8, layers 0-2 sliding,
layer 3 global) whose sliding-window layers read and write a pool of window x sequences +
n_batch cells, against the same model on the unified cache (window as a mask only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcache.iswa import ISWAMemory
from kvcache.unified import UnifiedMemory
from model.load.loader import LoadedModel, load_model
from model.runner.worker import ModelWorker, make_worker
from scheduler.plan import SamplingParams
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.scheduler.fakes import Outcome, make_config, make_prompt, step
from tests.tiny_models import write_tiny_gemma3

CFG = dict(n_cells=512, n_seq_max=6, n_batch=32, n_ctx_seq=96)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(write_tiny_gemma3(Path(tmp_path_factory.mktemp("gemma")) / "tiny"))


def request(req_id: str, prompt: list[int], max_tokens: int, **kw: object) -> Request:
    kw.setdefault("sampling", SamplingParams(temperature=0.0))
    return Request(req_id, prompt, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


def serve(
    gemma: LoadedModel, batches: list[list[Request]], kind: str, **cfg: object
) -> tuple[Outcome, Scheduler, ModelWorker]:
    """Each batch of requests to completion, one after the other, on one memory."""
    config = make_config(**{**CFG, **cfg}, memory_spec=gemma.config.memory_spec, memory=kind)
    memory = config.make_memory()
    group_cells = [memory.pools[i].cells.n_cells for i in memory.group_pools]
    worker = make_worker(gemma, config.n_cells, group_cells=group_cells)
    sched, outcome = Scheduler(config, memory), Outcome()
    for batch in batches:
        for r in batch:
            sched.add_request(r)
        while sched.has_work:
            step(sched, worker, outcome)  # type: ignore[arg-type]
    return outcome, sched, worker


def test_the_window_layers_use_the_small_pool_and_give_the_unified_output(gemma) -> None:
    reqs = [request(f"r{i}", make_prompt(20 + 9 * i, seed=i), 24) for i in range(4)]
    seeded = SamplingParams(temperature=0.9, seed=5)
    reqs.append(request("n2", make_prompt(30, seed=9), 20, n=2, sampling=seeded))
    swa, sched, worker = serve(gemma, [reqs], "iswa")
    assert isinstance(sched.memory, ISWAMemory)
    # full layer, window layers (and n_cells / 4 for the prefix index's windows)
    assert [s.n_cells for s in worker.kv] == [512, 8 * 6 + 32 + 512 // 4]
    unified, usched, uworker = serve(gemma, [reqs], "unified")
    assert isinstance(usched.memory, UnifiedMemory)
    assert [s.n_cells for s in uworker.kv] == [512, 512]
    assert swa.tokens == unified.tokens
    assert len(swa.tokens[("r3", 0)]) == 24 and len(swa.tokens[("n2", 1)]) == 20


def test_prefix_reuse_and_context_shift_give_the_cold_output(gemma) -> None:
    first = request("a", make_prompt(40, seed=1), 12)
    warm, sched, _ = serve(gemma, [[first]], "iswa")
    follow = request("b", first.prompt_ids + warm.tokens[("a", 0)] + make_prompt(6, seed=2), 10)
    out, sched2, _ = serve(gemma, [[first], [follow]], "iswa")
    assert out.finish[("b", 0)].num_cached_tokens == 40 + 12 - 1
    cold, _, _ = serve(gemma, [[follow]], "unified", prefix_cache=False)
    assert out.tokens[("b", 0)] == cold.tokens[("b", 0)]

    long = request("c", make_prompt(30, seed=3), 150, n_keep=4)
    shifted, sched3, _ = serve(gemma, [[long]], "iswa", n_ctx_seq=64)
    unified, _, _ = serve(gemma, [[long]], "unified", n_ctx_seq=64)
    assert sched3.counters.num_context_shifts > 0
    assert shifted.tokens[("c", 0)] == unified.tokens[("c", 0)]


def test_a_burst_shares_the_prefix_a_running_prompt_computes(gemma) -> None:
    # the readers' chunks stop at the shared length, where the window pool still holds what
    # the waiters' first rows read
    system = make_prompt(50, seed=7)
    burst = [request(f"q{i}", system + [1 + i] + make_prompt(5, seed=i), 8) for i in range(4)]
    swa, sched, _ = serve(gemma, [burst], "iswa", prefix_wait_min=16)
    assert sched.counters.prefix_running_hit_tokens == 3 * 50
    assert sched.counters.num_prompt_tokens == 56 + 3 * 6
    cold, _, _ = serve(gemma, [burst], "unified", prefix_cache=False)
    assert swa.tokens == cold.tokens


def test_conversations_past_the_seq_ids_continue_from_the_index_with_the_cold_output(gemma) -> None:
    # 2 seq ids, 8 conversations of 20 + 6 tokens: each demoted holder leaves its window in
    # the index, so every continuation reuses its whole history
    firsts = [request(f"t{i}", make_prompt(20, seed=40 + i), 6) for i in range(8)]
    warm, _, _ = serve(gemma, [firsts], "iswa")
    follows = [
        request(f"f{i}", r.prompt_ids + warm.tokens[(r.req_id, 0)] + make_prompt(4, seed=i), 6)
        for i, r in enumerate(firsts)
    ]
    out, sched, _ = serve(
        gemma, [[r] for r in firsts] + [[f] for f in follows], "iswa", n_seq_max=2
    )
    radix = sched.seq_ids.radix
    assert radix is not None and radix.num_window_cells[0] > 0
    for f in follows:
        assert out.finish[(f.req_id, 0)].num_cached_tokens == 20 + 6 - 1
    cold, _, _ = serve(gemma, [follows], "unified", prefix_cache=False)
    assert all(out.tokens[(f.req_id, 0)] == cold.tokens[(f.req_id, 0)] for f in follows)
    sched.memory.check()
