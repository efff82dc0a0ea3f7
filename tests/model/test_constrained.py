"""Structured outputs in the engine: the real worker on SmolLM2-135M, llguidance masks.

Every constrained output must be valid by construction, whatever shares its steps, and a
greedy one must equal the same request served alone.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from model.load.loader import LoadedModel
from model.runner.grammar import GrammarCompiler, GrammarError, GrammarSpec
from model.runner.token_mask import MaskFiller
from model.runner.worker import make_worker
from scheduler.plan import SamplingParams
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.scheduler.fakes import Outcome, make_config, step

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
TOPICS = ["a pirate", "a chef", "a child", "an astronaut", "a farmer", "a painter"]


@pytest.fixture(scope="module")
def compiler(smollm: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(smollm.tokenizer, smollm.config.vocab_size)


def chat_prompt(smollm: LoadedModel, text: str) -> list[int]:
    rendered = smollm.chat_template.render([{"role": "user", "content": text}])
    return smollm.tokenizer.encode(rendered)


def person_request(
    smollm: LoadedModel, compiler: GrammarCompiler, req_id: str, topic: str, **kw: object
) -> Request:
    kw.setdefault("sampling", SamplingParams(temperature=0.0))
    kw.setdefault("grammar", compiler.compile(GrammarSpec.json_schema(PERSON)))
    prompt = chat_prompt(smollm, f"Describe {topic} as JSON: name, age, favourite color.")
    return Request(
        req_id,
        prompt,
        max_tokens=60,
        stop_token_ids=frozenset(smollm.tokenizer.eos_ids),
        **kw,  # type: ignore[arg-type]
    )


def plain_request(smollm: LoadedModel, req_id: str, topic: str) -> Request:
    prompt = chat_prompt(smollm, f"Tell me about {topic}.")
    return Request(
        req_id,
        prompt,
        SamplingParams(temperature=0.0),
        max_tokens=24,
        stop_token_ids=frozenset(smollm.tokenizer.eos_ids),
    )


def serve(
    smollm: LoadedModel, batches: list[list[Request]], **cfg: object
) -> tuple[Outcome, Scheduler]:
    """Runs each batch to completion, one after the other, on one cache."""
    config = make_config(**{"n_cells": 2048, "n_ctx_seq": 256, "n_batch": 128, **cfg})
    sched = Scheduler(config)
    worker = make_worker(smollm, config.n_cells)
    outcome = Outcome()
    for batch in batches:
        for r in batch:
            sched.add_request(r)
        while sched.has_work:
            step(sched, worker, outcome)  # type: ignore[arg-type]
    return outcome, sched


def texts(smollm: LoadedModel, outcome: Outcome) -> dict[tuple[str, int], str]:
    return {k: smollm.tokenizer.decode(v) for k, v in outcome.tokens.items()}


def assert_people(smollm: LoadedModel, outcome: Outcome, keys: list[tuple[str, int]]) -> None:
    for key in keys:
        assert outcome.finish[key].reason == "stop", key
        jsonschema.validate(json.loads(smollm.tokenizer.decode(outcome.tokens[key])), PERSON)


def test_constrained_rows_beside_unconstrained_ones_equal_solo_runs(
    smollm: LoadedModel, compiler: GrammarCompiler
) -> None:
    def workload() -> list[Request]:
        reqs = [person_request(smollm, compiler, f"j{i}", t) for i, t in enumerate(TOPICS[:3])]
        return reqs + [plain_request(smollm, f"p{i}", t) for i, t in enumerate(TOPICS[:3])]

    mixed, _ = serve(smollm, [workload()])
    assert_people(smollm, mixed, [(f"j{i}", 0) for i in range(3)])
    for r in workload()[1:5]:  # two of each kind
        solo, _ = serve(smollm, [[r]])
        assert solo.tokens[(r.req_id, 0)] == mixed.tokens[(r.req_id, 0)], r.req_id
    # the unconstrained prompt does not answer in JSON on its own: the mask did the work
    assert not texts(smollm, mixed)[("p0", 0)].lstrip().startswith("{")


def test_n2_forks_copy_the_matcher(smollm: LoadedModel, compiler: GrammarCompiler) -> None:
    sampling = SamplingParams(temperature=1.0, seed=11)
    req = person_request(smollm, compiler, "n", TOPICS[0], n=2, sampling=sampling)
    out, _ = serve(smollm, [[req]])
    assert_people(smollm, out, [("n", 0), ("n", 1)])
    assert out.tokens[("n", 0)] != out.tokens[("n", 1)]
    again, _ = serve(
        smollm, [[person_request(smollm, compiler, "n", TOPICS[0], n=2, sampling=sampling)]]
    )
    assert again.tokens == out.tokens


def test_preemption_keeps_the_matcher_and_the_output(
    smollm: LoadedModel, compiler: GrammarCompiler
) -> None:
    def workload() -> list[Request]:
        return [person_request(smollm, compiler, f"j{i}", t) for i, t in enumerate(TOPICS[:4])]

    prompt_len = len(workload()[0].prompt_ids)
    n_ctx = prompt_len + 64
    tight, t_sched = serve(
        smollm, [workload()], n_cells=2 * n_ctx, n_ctx_seq=n_ctx, prefix_cache=False
    )
    roomy, r_sched = serve(smollm, [workload()], n_ctx_seq=n_ctx, prefix_cache=False)
    assert t_sched.counters.num_preemptions > 0 and r_sched.counters.num_preemptions == 0
    assert tight.tokens == roomy.tokens
    assert_people(smollm, tight, [(f"j{i}", 0) for i in range(4)])
    assert t_sched.memory.num_used == 0


def test_prefix_cache_hit_gives_the_cold_output(
    smollm: LoadedModel, compiler: GrammarCompiler
) -> None:
    first = person_request(smollm, compiler, "a", TOPICS[1])
    second = person_request(smollm, compiler, "b", TOPICS[1])
    warm, _ = serve(smollm, [[first], [second]])
    assert warm.finish[("b", 0)].num_cached_tokens > 0
    assert warm.tokens[("a", 0)] == warm.tokens[("b", 0)]
    assert_people(smollm, warm, [("a", 0), ("b", 0)])


def test_context_shift_leaves_the_matcher_intact(
    smollm: LoadedModel, compiler: GrammarCompiler
) -> None:
    req = person_request(smollm, compiler, "s", TOPICS[3])
    n_ctx = len(req.prompt_ids) + 12  # the JSON needs more: the context shifts under it
    out, sched = serve(smollm, [[req]], n_ctx_seq=n_ctx, prefix_cache=False)
    assert sched.counters.num_context_shifts > 0
    assert_people(smollm, out, [("s", 0)])


def test_max_tokens_ends_a_constrained_choice_with_length(
    smollm: LoadedModel, compiler: GrammarCompiler
) -> None:
    req = person_request(smollm, compiler, "m", TOPICS[2])
    req.max_tokens = 5
    out, sched = serve(smollm, [[req]])
    assert out.finish[("m", 0)].reason == "length"
    assert len(out.tokens[("m", 0)]) == 5
    assert texts(smollm, out)[("m", 0)].startswith('{"name": "')
    assert not sched.running and not sched.has_work


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        (GrammarSpec("regex", r"[0-9]{3}-[0-9]{4}"), r"[0-9]{3}-[0-9]{4}"),
        (GrammarSpec.choice(["positive", "negative"]), r"positive|negative"),
        (GrammarSpec("gbnf", 'root ::= "yes" | "no"'), r"yes|no"),
        (GrammarSpec("lark", 'start: "id-" /[a-z]{2,4}/'), r"id-[a-z]{2,4}"),
    ],
)
def test_regex_choice_and_grammars_hold(
    smollm: LoadedModel, compiler: GrammarCompiler, spec: GrammarSpec, pattern: str
) -> None:
    prompt = chat_prompt(smollm, "Answer with one word.")
    sampling = SamplingParams(temperature=1.0, seed=5)
    req = Request("g", prompt, sampling, max_tokens=30, n=3, grammar=compiler.compile(spec))
    req.stop_token_ids = frozenset(smollm.tokenizer.eos_ids)
    out, _ = serve(smollm, [[req]])
    for i in range(3):
        assert out.finish[("g", i)].reason == "stop"
        assert re.fullmatch(pattern, texts(smollm, out)[("g", i)]), texts(smollm, out)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec("regex", "[a-"), "unclosed character class"),
        (GrammarSpec("json_schema", '{"type": "objectx"}'), "objectx"),
        (GrammarSpec("lark", "start: undefined_rule"), "undefined_rule"),
        (GrammarSpec("gbnf", "root ::= ("), "GBNF"),
        (GrammarSpec("json_schema", "{not json"), "JSON"),
        (GrammarSpec.choice([]), "non-empty"),
    ],
)
def test_a_bad_grammar_is_a_clear_error(
    compiler: GrammarCompiler, spec: GrammarSpec, message: str
) -> None:
    with pytest.raises(GrammarError, match=message):
        compiler.compile(spec)


def test_compiled_grammars_are_cached_by_text(compiler: GrammarCompiler) -> None:
    spec = GrammarSpec.json_schema(PERSON)
    assert compiler.compile(spec) is compiler.compile(GrammarSpec.json_schema(dict(PERSON)))


def test_unconstrained_rows_compute_no_mask(smollm: LoadedModel, compiler: GrammarCompiler) -> None:
    from scheduler.plan import SampleRow

    row = SampleRow(row=0, params=SamplingParams(), seed=0, output_index=0, num_prompt=1)
    filler = MaskFiller(smollm.config.vocab_size)
    assert filler.start([row, row]) is None
    constraint = compiler.compile(GrammarSpec("regex", "ab")).new_constraint()
    constrained = SampleRow(0, SamplingParams(), 0, 0, 1, constraint=constraint)
    future = filler.start([row, constrained])
    assert future is not None
    masks = future.result()
    assert (masks[0] == -1).all()  # every token allowed
    allowed = {t for t in range(smollm.config.vocab_size) if masks[1][t // 32] >> (t % 32) & 1}
    assert allowed and all(smollm.tokenizer.decode([t]) in ("a", "ab") for t in allowed)


def test_masked_rows_sample_only_allowed_tokens(
    smollm: LoadedModel, compiler: GrammarCompiler
) -> None:
    import torch

    from model.runner.sampling import sample
    from scheduler.plan import SampleRow

    vocab = smollm.config.vocab_size
    constraint = compiler.compile(GrammarSpec("regex", "(yes|no|maybe)!")).new_constraint()
    greedy = SampleRow(0, SamplingParams(temperature=0.0), 0, 0, 1, constraint=constraint)
    rows = (
        [greedy]
        + [
            SampleRow(
                i + 1,
                SamplingParams(temperature=1.5, top_k=50),
                seed=i,
                output_index=0,
                num_prompt=1,
                constraint=constraint,
            )
            for i in range(16)
        ]
        + [SampleRow(17, SamplingParams(temperature=0.0), 0, 0, 1)]
    )  # unconstrained
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(0))
    future = MaskFiller(vocab).start(rows)
    assert future is not None
    masks = future.result()
    allowed = {t for t in range(vocab) if masks[0][t // 32] >> (t % 32) & 1}
    out = sample(logits, rows, masks).token_ids
    assert all(t in allowed for t in out[:-1])
    assert out[0] == max(allowed, key=lambda t: float(logits[0, t]))  # the best allowed one
    assert out[-1] == int(logits[-1].argmax())  # the unconstrained row is untouched
    assert len(set(out[1:-1])) > 1  # sampled, not forced to one token


def test_speculative_drafts_follow_the_grammar(
    smollm: LoadedModel, compiler: GrammarCompiler
) -> None:
    """n-gram drafts of a constrained request are cut where the grammar rejects them and
    verified under the matcher that consumed the drafts before them: the same JSON as
    without speculation, greedy and seeded."""
    from scheduler.speculative import SpecConfig

    example = '{"name": "Ann", "age": 30, "color": "red"}'

    def workload() -> list[Request]:
        out = []
        for i, topic in enumerate(TOPICS[:3]):
            sampling = SamplingParams(temperature=0.0 if i != 1 else 0.8, seed=i)
            prompt = chat_prompt(smollm, f"Describe {topic} as JSON like {example} {example}")
            out.append(
                Request(
                    f"s{i}",
                    prompt,
                    sampling,
                    max_tokens=60,
                    stop_token_ids=frozenset(smollm.tokenizer.eos_ids),
                    grammar=compiler.compile(GrammarSpec.json_schema(PERSON)),
                )
            )
        return out

    plain, _ = serve(smollm, [[r] for r in workload()])
    spec, sched = serve(smollm, [[r] for r in workload()], spec=SpecConfig(kind="ngram"))
    assert spec.tokens == plain.tokens
    assert_people(smollm, spec, [(f"s{i}", 0) for i in range(3)])
    assert sched.spec.stats.num_accepted_tokens > 0
