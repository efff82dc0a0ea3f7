"""Speculative decoding with the real worker on a tiny random Llama: the drafted rows of a
sequence verified in one forward give the tokens that decoding one at a time gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from model.load.loader import LoadedModel, load_model
from model.runner.worker import make_worker
from scheduler.plan import SamplingParams
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from scheduler.speculative import SpecConfig
from tests.scheduler.fakes import Outcome, make_config, make_prompt, step
from tests.tiny_models import write_tiny_gemma3, write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(write_tiny_llama(Path(tmp_path_factory.mktemp("tiny"))))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """Sliding windows of 8 (the iSWA memory): the prompts and outputs run far past them."""
    return load_model(write_tiny_gemma3(Path(tmp_path_factory.mktemp("gemma")) / "g"))


def workload() -> list[Request]:
    """Prompts that repeat a phrase (what n-gram lookup drafts from), greedy and seeded."""
    reqs = []
    for i in range(6):
        phrase = make_prompt(6 + i, seed=i)
        sampling = SamplingParams(temperature=0.0 if i % 2 == 0 else 0.7, seed=i)
        reqs.append(Request(f"r{i}", phrase * 4, sampling=sampling, max_tokens=48, ignore_eos=True))
    return reqs


def serve(tiny: LoadedModel, kind: str, batch_invariant: bool) -> tuple[Outcome, Scheduler]:
    config = make_config(
        n_cells=1024,
        n_ctx_seq=256,
        n_batch=128,
        spec=SpecConfig(kind=kind),
        memory_spec=tiny.config.memory_spec,
    )
    sched = Scheduler(config)
    pools = [sched.memory.pools[i].cells.n_cells for i in sched.memory.group_pools]
    worker = make_worker(tiny, config.n_cells, batch_invariant=batch_invariant, group_cells=pools)
    outcome = Outcome()
    # one request at a time (c=1: drafts are allowed), then all at once
    for batch in [[r] for r in workload()] + [workload()]:
        for r in batch:
            r.req_id += f"-{outcome.num_steps}"
            sched.add_request(r)
        while sched.has_work:
            step(sched, worker, outcome)  # type: ignore[arg-type]
    return outcome, sched


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_speculation_keeps_every_token(tiny: LoadedModel, batch_invariant: bool) -> None:
    plain, _ = serve(tiny, "none", batch_invariant)
    spec, sched = serve(tiny, "ngram", batch_invariant)
    stats = sched.spec.stats
    assert stats.num_drafts > 10 and stats.num_accepted_tokens > 0
    assert spec.num_steps < plain.num_steps
    # keys carry the step a request was submitted at: compare by request order instead
    assert list(spec.tokens.values()) == list(plain.tokens.values())


def test_sliding_window_model_keeps_every_token(gemma: LoadedModel) -> None:
    plain, p_sched = serve(gemma, "none", False)
    spec, sched = serve(gemma, "ngram", False)
    assert type(sched.memory).__name__ == "ISWAMemory" and sched.spec.enabled
    assert sched.spec.stats.num_accepted_tokens > 0
    assert list(spec.tokens.values()) == list(plain.tokens.values())
