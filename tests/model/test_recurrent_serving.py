"""The real scheduler and memory (recurrent / hybrid) driving the real worker on a random Mamba2,
a random Granite 4.0-H, a random LFM2 (short-conv states) and a random Falcon-H1 (attention and
Mamba2 in every layer): batching, forks, the prefix cache
through state checkpoints and preemption give what each request gives alone; and
`python -m cli` serves a Mamba2 folder."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from model.load.loader import LoadedModel, load_model
from model.runner.worker import ModelWorker, make_worker
from scheduler.plan import SamplingParams
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from scheduler.speculative import Drafter, SpecConfig
from tests.live_server import start_server_process
from tests.scheduler.fakes import Outcome, make_config, make_prompt, step
from tests.tiny_ssm import (
    write_tiny_falcon_h1,
    write_tiny_granite_hybrid,
    write_tiny_lfm2,
    write_tiny_mamba2,
)

CFG = dict(n_cells=1024, n_seq_max=10, n_batch=64, n_ctx_seq=512)


@pytest.fixture(scope="module", params=["mamba2", "granite", "lfm2", "falcon_h1"])
def tiny(request, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = Path(tmp_path_factory.mktemp(request.param)) / "tiny"
    if request.param == "mamba2":
        return load_model(write_tiny_mamba2(folder))
    if request.param == "lfm2":
        return load_model(write_tiny_lfm2(folder))
    if request.param == "falcon_h1":
        return load_model(write_tiny_falcon_h1(folder, long_memory=True))
    return load_model(write_tiny_granite_hybrid(folder))


def request(req_id: str, prompt: list[int], max_tokens: int, **kw: object) -> Request:
    kw.setdefault("sampling", SamplingParams(temperature=0.0))
    return Request(req_id, prompt, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


def serve(
    tiny: LoadedModel,
    batches: list[list[Request]],
    invariant: bool = False,
    drafter: Drafter | None = None,
    **cfg: object,
) -> tuple[Outcome, Scheduler, ModelWorker]:
    """Each batch of requests to completion, one after the other, on one memory (the
    worker's storage sized from it). `invariant`: the --batch-invariant worker."""
    config = make_config(**{**CFG, **cfg}, memory_spec=tiny.config.memory_spec)
    memory = config.make_memory()
    group_cells = [memory.pools[i].cells.n_cells for i in memory.group_pools]
    worker = make_worker(tiny, config.n_cells, group_cells=group_cells, batch_invariant=invariant)
    sched, outcome = Scheduler(config, memory, drafter), Outcome()
    for batch in batches:
        for r in batch:
            sched.add_request(r)
        while sched.has_work:
            step(sched, worker, outcome)  # type: ignore[arg-type]
    return outcome, sched, worker


@pytest.mark.parametrize("invariant", [False, True])
def test_eight_concurrent_sequences_each_equal_alone(tiny, invariant) -> None:
    lengths = [3, 17, 40, 90, 130, 8, 61, 300]
    reqs = [request(f"r{i}", make_prompt(n, seed=i), 12 + i) for i, n in enumerate(lengths)]
    together, _, worker = serve(tiny, [reqs], invariant)
    assert worker.state_bytes_per_slot > 0
    for r in reqs:
        alone, _, _ = serve(tiny, [[request(r.req_id, r.prompt_ids, r.max_tokens)]], invariant)
        assert together.tokens[(r.req_id, 0)] == alone.tokens[(r.req_id, 0)], r.req_id


def test_n2_forks_copy_the_state(tiny) -> None:
    """Greedy choices of one request are the single greedy run; seeded ones are the same
    whether the prompt's state was forked or the choices ran with the prefix cache off."""
    prompt = make_prompt(70, seed=11)
    forked, _, _ = serve(tiny, [[request("g", prompt, 16, n=2)]])
    single, _, _ = serve(tiny, [[request("g", prompt, 16)]])
    assert forked.tokens[("g", 0)] == forked.tokens[("g", 1)] == single.tokens[("g", 0)]
    seeded = SamplingParams(temperature=0.9, seed=3)
    a, _, _ = serve(tiny, [[request("s", prompt, 16, n=2, sampling=seeded)]])
    b, _, _ = serve(tiny, [[request("s", prompt, 16, n=2, sampling=seeded)]], prefix_cache=False)
    assert a.tokens[("s", 0)] != a.tokens[("s", 1)]
    assert a.tokens == b.tokens


def test_prefix_cache_hit_gives_the_cold_output(tiny) -> None:
    system = make_prompt(300, seed=1)  # past a checkpoint interval (256)
    first = request("a", system + make_prompt(8, seed=2), 10)
    second = request("b", system + make_prompt(8, seed=3), 16)
    warm, _, _ = serve(tiny, [[first], [second]])
    assert warm.finish[("b", 0)].num_cached_tokens >= 256
    cold, _, _ = serve(tiny, [[second]], prefix_cache=False)
    assert warm.tokens[("b", 0)] == cold.tokens[("b", 0)]
    again = request("c", first.prompt_ids, 10)  # the same prompt twice
    repeat, _, _ = serve(tiny, [[first], [again]])
    assert repeat.finish[("c", 0)].num_cached_tokens > 0
    assert repeat.tokens[("c", 0)] == warm.tokens[("a", 0)]


def test_tiny_memory_with_preemptions_equals_a_large_one(tiny) -> None:
    def workload() -> list[Request]:
        reqs = [request(f"g{i}", make_prompt(20 + 7 * i, seed=i), 24) for i in range(5)]
        seeded = SamplingParams(temperature=0.9, seed=7)
        reqs.append(request("s", make_prompt(15, seed=9), 20, n=2, sampling=seeded))
        return reqs

    tiny_cfg: dict[str, object] = dict(n_cells=96, n_ctx_seq=64, prefix_cache=False)
    if not tiny.config.memory_spec.has_full_attention:
        tiny_cfg |= dict(n_seq_max=3)  # Mamba2: the slots are what runs out
    tight, t_sched, _ = serve(tiny, [workload()], **tiny_cfg)
    roomy, r_sched, _ = serve(tiny, [workload()], n_ctx_seq=64, prefix_cache=False)
    assert r_sched.counters.num_preemptions == 0
    if tiny.config.memory_spec.has_full_attention:
        assert t_sched.counters.num_preemptions > 0
    assert tight.tokens == roomy.tokens


class Replay:
    """A drafter that knows the plain run's outputs (prompt + output each): it proposes a
    sequence's true next tokens with those at positions divisible by `wrong_every` changed,
    so that rounds accept 0 to wrong_every - 1 drafts and roll the rest back."""

    def __init__(self, outputs: list[list[int]], wrong_every: int) -> None:
        self.outputs = outputs
        self.wrong_every = wrong_every

    def propose(self, asks: list[tuple[int, list[int], int]], live: set[int]) -> list[list[int]]:
        out = []
        for _, tokens, k in asks:
            n, w = len(tokens), self.wrong_every
            full = next(o for o in self.outputs if o[:n] == list(tokens))
            out.append([t + 1 if (n + j) % w == 0 else t for j, t in enumerate(full[n : n + k])])
        return out


@pytest.mark.parametrize("invariant", [True, False])
def test_speculation_rolls_the_state_back_to_each_tokens_own(tiny, invariant) -> None:
    """Drafted rows verified in one scan, the state rolled back to the checkpoint at the
    first rejected draft: the tokens of decoding one at a time, alone and four at once."""

    def batches() -> list[list[Request]]:
        reqs = []
        for i in range(4):
            seeded = SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i)
            reqs.append(request(f"q{i}", make_prompt(20 + 9 * i, seed=20 + i), 40, sampling=seeded))
        alone = [request(r.req_id + "-alone", r.prompt_ids, 40, sampling=r.sampling) for r in reqs]
        return [*([r] for r in alone), reqs]

    plain, _, _ = serve(tiny, batches(), invariant)
    prompts = {r.req_id: r.prompt_ids for b in batches() for r in b}
    # the plain run's next tokens, every fourth changed: rounds accept 0-3 drafts
    drafter = Replay([prompts[key] + toks for (key, _), toks in plain.tokens.items()], 4)
    spec_cfg = SpecConfig(kind="draft", draft_max=6, draft_seqs_max=4)
    drafted, sched, _ = serve(tiny, batches(), invariant, drafter=drafter, spec=spec_cfg)
    stats = sched.spec.stats
    assert stats.num_drafts > 20 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert drafted.tokens == plain.tokens


def test_a_draft_model_for_a_mamba2_without_the_targets_padded_ids(tmp_path) -> None:
    """A transformer draft for a Mamba2 target, the same tokenizer but 320 embedding rows
    against 2048: the random target emits padded ids the draft has no row for (the engine
    died on the draft's embedding before); a sequence holding one gets no more drafts, the
    text is plain decoding's, and the draft drafted before that."""
    from kvcache.make import make_memory
    from scheduler.draft import DraftModel
    from tests.tiny_models import write_tiny_llama

    target = load_model(write_tiny_mamba2(tmp_path / "m"))
    draft = load_model(write_tiny_llama(tmp_path / "d", n_layers=1, seed=3))
    assert target.config.vocab_size > draft.config.vocab_size

    def batches() -> list[list[Request]]:
        return [[request(f"v{i}", make_prompt(12 + 5 * i, seed=40 + i), 40)] for i in range(3)]

    plain, _, _ = serve(target, batches())
    limit = draft.config.vocab_size
    assert any(t >= limit for toks in plain.tokens.values() for t in toks)
    memory = make_memory(draft.config.memory_spec, 1024, 10, 64, "unified")
    drafter = DraftModel(make_worker(draft, 1024), memory, 64, vocab_limit=limit)
    spec = SpecConfig(kind="draft", draft_max=4, draft_seqs_max=4)
    drafted, sched, _ = serve(target, batches(), drafter=drafter, spec=spec)
    assert drafted.tokens == plain.tokens
    assert sched.spec.stats.num_drafts > 0


def test_cli_serves_a_mamba2_folder(tmp_path) -> None:
    folder = write_tiny_mamba2(tmp_path / "mamba2")
    server = start_server_process(
        "--model", str(folder), "--n-cells", "256", "--dtype", "float32", "--quant", "none",
        "--spec-type", "ngram",
    )  # fmt: skip
    try:
        body = {"model": "mamba2", "prompt": "Hello world", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
        plain = {**body, "speculative": False}  # the request opts out of drafting
        alone = httpx.post(f"{server.url}/v1/completions", json=plain, timeout=60).json()
        assert alone["choices"][0]["text"] == r.json()["choices"][0]["text"]
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert "vllm:spec_decode_num_drafts_total" in metrics  # a Mamba2 is speculated
        per_slot = 3 * (192 * 3 + 8 * 16 * 16) * 4  # 3 layers: conv + ssm, float32
        assert f'cellserve_state_slot_bytes{{pool="recurrent"}} {per_slot}.0' in metrics

        def value(name: str) -> float:
            return float(metrics.split(name + " ")[1].split()[0])

        slots = value('cellserve_state_slots_total{pool="recurrent"}')
        assert value('cellserve_memory_bytes{part="state_slots"}') == per_slot * slots > 0
    finally:
        server.stop()
        server.log.close()


def test_a_lone_sequence_failing_midway_leaves_nothing_behind(tiny, monkeypatch) -> None:
    """A plan of one sequence saves no state (ModelWorker._save_states): a forward that raises
    after the first layers moved the state fails the request (engine: isolate), its slot goes
    uncached, and the same prompt next (prefix cache on) gets the tokens of a clean run."""
    import asyncio

    from scheduler.engine import Engine
    from scheduler.request import FinishEvent, TokenEvent

    prompt = make_prompt(40, seed=5)
    want = serve(tiny, [[request("ref", prompt, 8)]])[0].tokens[("ref", 0)]
    config = make_config(**CFG, memory_spec=tiny.config.memory_spec)
    memory = config.make_memory()
    group_cells = [memory.pools[i].cells.n_cells for i in memory.group_pools]
    worker = make_worker(tiny, config.n_cells, group_cells=group_cells)
    engine = Engine(worker, config, memory=memory)
    last = worker.model.layers[-1]
    forward, calls = last.forward, [0]

    def failing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        if calls[0] == 3:  # the second decode step, after the other layers moved the state
            raise RuntimeError("injected fault in the last layer")
        return forward(*args, **kwargs)

    monkeypatch.setattr(last, "forward", failing)

    async def collect(req: Request) -> list:
        return [ev async for ev in engine.submit(req)]

    async def main() -> tuple[list, list]:
        engine.start()
        failed = await collect(request("bad", prompt, 8))
        return failed, await collect(request("again", prompt, 8))

    try:
        failed, again = asyncio.run(main())
    finally:
        engine.shutdown(drain_timeout=1)
    assert calls[0] > 3
    end = failed[-1]
    assert isinstance(end, FinishEvent) and end.reason == "error" and "injected" in str(end.error)
    assert [e.token_id for e in again if isinstance(e, TokenEvent)] == want
    sched = engine.scheduler
    assert len(sched.prefix) == 1  # "again"'s holder; the failed one left none
    sched.clear_prefix_cache()
    assert sched.memory.num_used == 0
