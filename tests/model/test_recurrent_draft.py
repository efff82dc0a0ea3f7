"""A recurrent or hybrid model as the draft of speculative decoding (scheduler/draft.py): its
state cannot forget rejected drafts, so each sequence keeps a backup of its state before the
draft rows and goes back to it; what it proposes after any acceptance pattern is what a draft
starting from nothing proposes, and the target's text is plain decoding's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from model.load.loader import LoadedModel, load_model
from model.runner.worker import make_worker
from scheduler.draft import DraftModel, draft_memory
from scheduler.plan import SamplingParams
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from scheduler.speculative import SpecConfig
from tests.scheduler.fakes import Outcome, make_config, make_prompt, step
from tests.tiny_ssm import write_tiny_granite_hybrid, write_tiny_lfm2, write_tiny_mamba2

WRITERS = {
    "mamba2": write_tiny_mamba2,
    "granite": write_tiny_granite_hybrid,
    "lfm2": write_tiny_lfm2,
}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def tiny(request, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:  # noqa: ANN001
    folder = Path(tmp_path_factory.mktemp(request.param)) / "tiny"
    return load_model(WRITERS[request.param](folder, seed=3))


def make_drafter(model: LoadedModel, n_seq: int = 4, n_batch: int = 64) -> DraftModel:
    memory = draft_memory(model.config.memory_spec, 1024, n_seq, n_batch)
    cells = [memory.pools[i].cells.n_cells for i in memory.group_pools]
    return DraftModel(make_worker(model, 1024, group_cells=cells), memory, n_batch)


def test_after_any_acceptance_it_proposes_what_a_fresh_draft_would(tiny) -> None:  # noqa: ANN001
    """Rounds of three sequences: each accepts a random number of its 4 drafts (none, some,
    all) and adds a token of its own; one seq id is then given to a new prompt and another
    forks a sequence's tokens (an n > 1 request)."""
    drafter = make_drafter(tiny)
    rng = random.Random(0)
    seqs = {s: make_prompt(10 + 7 * s, seed=s) for s in range(3)}
    accepted, last = [], {}  # last[s]: how many of its drafts s accepted last round
    for rnd in range(12):
        if rnd == 6:
            seqs[1] = make_prompt(9, seed=50)  # the seq id now serves another request
            del last[1]
        if rnd == 8:
            seqs[3] = list(seqs[0])  # a fork of seq 0
        asks = [(s, list(t), 4) for s, t in seqs.items()]
        rows = drafter.num_rows
        got = drafter.propose(asks, set(seqs))
        fresh = make_drafter(tiny, n_batch=4096).propose(asks, set(seqs))
        assert got == fresh, f"round {rnd}"
        drafter.memory.check()
        if set(last) == set(seqs):
            # the drafts it fed (3) and, from the state it kept, the accepted ones again and
            # the target's token: from the backup after 0-2, its own tail after 3 or 4
            refed = [{3: 1, 4: 2}.get(j, j + 1) for j in last.values()]
            assert drafter.num_rows - rows == sum(refed) + 3 * len(seqs), f"round {rnd}"
        for s, drafts in zip(seqs, got, strict=True):
            assert len(drafts) == 4
            last[s] = rng.randint(0, len(drafts))
            accepted.append(last[s])
            seqs[s] = seqs[s] + drafts[: last[s]] + [rng.randrange(300)]
    assert min(accepted) == 0 and max(accepted) == 4 and any(0 < j < 3 for j in accepted)
    # a sequence no longer in use leaves nothing behind, its backup included
    drafter.propose([(0, seqs[0], 2)], {0})
    assert set(drafter.held) <= {0, drafter.n_seq}
    for s in (1, 2, 3):
        assert drafter.memory.seq_pos_max(s) < 0 and drafter.memory.seq_pos_max(s + 4) < 0


def test_a_prompt_past_the_batch_is_read_over_several_calls(tiny) -> None:  # noqa: ANN001
    drafter = make_drafter(tiny, n_batch=16)
    prompt = make_prompt(40, seed=7)
    assert drafter.propose([(0, prompt, 3)], {0}) == [[]]  # 16 tokens read, no logits yet
    assert drafter.propose([(0, prompt, 3)], {0}) == [[]]
    got = drafter.propose([(0, prompt, 3)], {0})
    assert got == make_drafter(tiny, n_batch=64).propose([(0, prompt, 3)], {0})
    assert len(got[0]) == 3 and drafter.num_rows == 40 + 2
    drafter.memory.check()


def test_the_model_as_its_own_draft_is_accepted_and_the_text_is_plain(tiny) -> None:  # noqa: ANN001
    def serve(drafter: DraftModel | None) -> tuple[Outcome, Scheduler]:
        config = make_config(
            n_cells=1024, n_seq_max=4, n_batch=64, n_ctx_seq=256,
            memory_spec=tiny.config.memory_spec,
            spec=SpecConfig(kind="draft" if drafter else "none", draft_max=4, draft_seqs_max=4),
        )  # fmt: skip
        memory = config.make_memory()
        cells = [memory.pools[i].cells.n_cells for i in memory.group_pools]
        worker = make_worker(tiny, config.n_cells, group_cells=cells)
        sched, outcome = Scheduler(config, memory, drafter), Outcome()
        for i in range(3):
            prompt = make_prompt(12 + 9 * i, seed=20 + i)
            greedy = SamplingParams(temperature=0.0)
            sched.add_request(Request(f"r{i}", prompt, greedy, max_tokens=24, ignore_eos=True))
        while sched.has_work:
            step(sched, worker, outcome)  # type: ignore[arg-type]
        return outcome, sched

    plain, _ = serve(None)
    drafted, sched = serve(make_drafter(tiny))
    assert drafted.tokens == plain.tokens
    stats = sched.spec.stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens >= 0.8 * stats.num_draft_tokens
