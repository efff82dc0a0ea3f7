"""Speculative decoding with a draft model (scheduler/draft.py) on tiny random Llamas: the
draft's own cache mirrors the target's sequences, its greedy tokens are verified in one target
step, and the text is the target's alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcache.make import make_memory
from model.load.loader import LoadedModel, load_model
from model.load.tokenizer import check_vocab
from model.runner.worker import make_worker
from scheduler.draft import DraftModel
from scheduler.plan import SamplingParams
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from scheduler.speculative import SpecConfig
from tests.scheduler.fakes import Outcome, make_config, make_prompt, step
from tests.tiny_models import write_tiny_llama


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    root = Path(tmp_path_factory.mktemp("tiny"))
    return {
        "target": load_model(write_tiny_llama(root / "t", n_layers=2, seed=0)),
        "other": load_model(write_tiny_llama(root / "o", n_layers=1, seed=5)),
        "fim": load_model(write_tiny_llama(root / "f", fim=True)),
    }


def workload() -> list[Request]:
    out = []
    for i in range(5):
        sampling = SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=i)
        prompt = make_prompt(20 + 5 * i, seed=i)
        out.append(Request(f"r{i}", prompt, sampling=sampling, max_tokens=40, ignore_eos=True))
    return out


def serve(
    models: dict[str, LoadedModel],
    kind: str,
    draft: str = "target",
    batches: list[list[Request]] | None = None,
    **cfg: object,
) -> tuple[Outcome, Scheduler, DraftModel | None]:
    """`batches` one after the other (default: workload() one request at a time, then all
    together, their ids suffixed with the step they came in)."""
    base: dict[str, object] = dict(n_cells=1024, n_ctx_seq=128, n_batch=64)
    # the mechanism under many sequences (the policy alone drafts for at most 2)
    config = make_config(**{**base, **cfg}, spec=SpecConfig(kind=kind, draft_seqs_max=16))
    drafter = None
    if kind == "draft":
        d = models[draft]
        memory = make_memory(d.config.memory_spec, 1024, config.n_seq_max, 64, "unified")
        drafter = DraftModel(make_worker(d, 1024), memory, 64)
    sched = Scheduler(config, drafter=drafter)
    worker = make_worker(models["target"], config.n_cells)
    outcome = Outcome()
    if batches is None:
        batches = [[r] for r in workload()] + [workload()]
        for i, batch in enumerate(batches):
            for r in batch:
                r.req_id += f"-{i}"
    for batch in batches:
        for r in batch:
            sched.add_request(r)
        while sched.has_work:
            step(sched, worker, outcome)  # type: ignore[arg-type]
    return outcome, sched, drafter


def test_the_target_as_its_own_draft_is_accepted_and_changes_nothing(models) -> None:  # noqa: ANN001
    plain, _, _ = serve(models, "none")
    spec, sched, drafter = serve(models, "draft")
    assert list(spec.tokens.values()) == list(plain.tokens.values())
    s = sched.spec.stats
    assert drafter is not None and drafter.num_forwards > 0
    # greedy rows take every draft of an identical model; sampled rows only some
    assert s.num_accepted_tokens > 0.5 * s.num_draft_tokens
    assert spec.num_steps < 0.6 * plain.num_steps


def test_another_draft_model_changes_nothing_either(models) -> None:  # noqa: ANN001
    plain, _, _ = serve(models, "none")
    spec, sched, drafter = serve(models, "draft", draft="other")
    assert list(spec.tokens.values()) == list(plain.tokens.values())
    assert sched.spec.stats.num_drafts > 0
    # finished sequences' draft cells go at the next proposal; a finished engine holds none
    # beyond the sequences still known to the draft
    assert drafter is not None
    used = drafter.memory.pools[0].cells.stats().used
    assert used <= sum(len(t) for t in drafter.held.values())


def test_the_draft_shares_what_it_computed_for_another_seq_id(models) -> None:  # noqa: ANN001
    """A prompt the target serves from its prefix cache (another seq id), or an n = 2 fork,
    is taken from the draft's own cells of the other seq id with seq_cp, not recomputed."""
    prompt = make_prompt(100, seed=9)

    def fed(reqs: list[list[Request]]) -> int:
        _, _, drafter = serve(models, "draft", "other", reqs, n_ctx_seq=256)
        assert drafter is not None
        return drafter.num_rows

    def req(rid: str, n: int = 1) -> Request:
        return Request(
            rid,
            prompt + [int(rid[-1])],
            max_tokens=8,
            ignore_eos=True,
            n=n,
            sampling=SamplingParams(temperature=0.0),
        )

    one = fed([[req("a1")]])
    two = fed([[req("a1")], [req("b2")]])
    assert two - one < 40  # b2 fed its suffix and its drafts, not the 100-token prompt again
    forked = fed([[req("c3", n=2)]])
    assert forked - one < 40


def test_through_preemption_and_context_shift(models) -> None:  # noqa: ANN001
    tight: dict[str, object] = dict(n_cells=100, n_ctx_seq=48, prefix_cache=False)
    plain, p_sched, _ = serve(models, "none", **tight)
    spec, s_sched, _ = serve(models, "draft", **tight)
    assert list(spec.tokens.values()) == list(plain.tokens.values())
    assert s_sched.counters.num_context_shifts > 0 and s_sched.counters.num_preemptions > 0
    assert s_sched.spec.stats.num_accepted_tokens > 0


def test_a_draft_with_another_tokenizer_is_refused(models) -> None:  # noqa: ANN001
    check_vocab(models["target"].tokenizer, models["other"].tokenizer)
    with pytest.raises(ValueError, match="must share a tokenizer"):
        check_vocab(models["target"].tokenizer, models["fim"].tokenizer)


def test_a_draft_model_drafts_only_for_few_sequences() -> None:
    from scheduler.speculative import Speculator

    spec = Speculator(SpecConfig(kind="draft"), True, drafter=object())  # type: ignore[arg-type]
    assert spec.step_budget(1) == 16 and spec.step_budget(2) == 15
    assert spec.step_budget(3) == 0
    ngram = Speculator(SpecConfig(kind="ngram"), True)
    assert ngram.step_budget(3) == 14 and ngram.step_budget(17) == 0


def test_a_reduced_draft_head_scores_the_asking_sequences_own_ids(tmp_path) -> None:  # noqa: ANN001
    """--draft-vocab: each draft forward names exactly the distinct ids at or above the head's
    rows that the asking sequences hold (BatchPlan.head_ids), and every proposal is below the
    rows or one of those."""
    folder = write_tiny_llama(tmp_path / "t", n_layers=2, seed=0)
    d = load_model(folder)
    rows = d.config.vocab_size // 2
    d.transformer.keep_head_rows(rows)
    memory = make_memory(d.config.memory_spec, 1024, 8, 64, "unified")
    drafter = DraftModel(make_worker(d, 1024), memory, 64, head_rows=rows)
    named: list[object] = []
    execute = drafter.worker.execute

    def spy(plan):  # noqa: ANN001, ANN202
        named.append(plan.head_ids)
        return execute(plan)

    drafter.worker.execute = spy  # type: ignore[method-assign]
    seqs = {0: [*make_prompt(30, seed=1), rows + 3, 5], 1: [*make_prompt(25, seed=2), rows - 1]}
    for _ in range(4):
        asks = [(sid, tokens, 6) for sid, tokens in seqs.items()]
        named.clear()
        got = drafter.propose(asks, set(seqs))
        want = sorted({t for tokens in seqs.values() for t in tokens if t >= rows})
        assert want and named and all(ids is not None and ids.tolist() == want for ids in named)
        for sid, proposal in zip(seqs, got, strict=True):
            assert proposal and all(t < rows or t in want for t in proposal)
            seqs[sid] = seqs[sid] + proposal[:3] + [rows + 7]  # 3 accepted, then the target's
