"""Speculative decoding through the real server (`--spec-type ngram`) on a tiny random Llama:
the same completions as a request that opts out, streamed and not, and /metrics and the cell
map count the drafts."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.live_server import start_server
from tests.server.test_prefix_sharing_server import scrape
from tests.tiny_models import write_tiny_llama

PROMPT = "Hello world! How are you today? " * 6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    folder = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    live = start_server(model=str(folder), n_cells=2048, spec_type="ngram", draft_max=8)
    yield live
    live.stop()


def complete(url: str, **extra: object) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, **extra}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_speculated_text_is_the_plain_text(server) -> None:  # noqa: ANN001
    url = server.url
    before = scrape(url)
    spec = complete(url)
    after = scrape(url)
    plain = complete(url, speculative=False)
    after_plain = scrape(url)
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    assert spec["usage"]["completion_tokens"] == 40
    drafts = after["vllm:spec_decode_num_drafts_total"] - before.get(
        "vllm:spec_decode_num_drafts_total", 0.0
    )
    accepted = after["cellserve_spec_decode_num_accepted_tokens_total"] - before.get(
        "cellserve_spec_decode_num_accepted_tokens_total", 0.0
    )
    assert drafts > 0 and accepted >= 0
    # the opted-out request drafted nothing
    assert (
        after_plain["vllm:spec_decode_num_drafts_total"]
        == after["vllm:spec_decode_num_drafts_total"]
    )
    assert (
        after["cellserve_spec_decode_acceptance_length_count"]
        == after["vllm:spec_decode_num_drafts_total"]
    )
    # llama.cpp's per-request cap, and a streamed request, give the same text too
    capped = complete(url, **{"speculative.n_max": 2})
    assert capped["choices"][0]["text"] == plain["choices"][0]["text"]
    streamed = ""
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["text"]
    assert streamed == plain["choices"][0]["text"]
    cells = httpx.get(f"{url}/v1/cache/cells").json()["speculative"]
    now = scrape(url)
    assert cells["num_drafts"] == now["vllm:spec_decode_num_drafts_total"]
    assert cells["num_accepted_tokens"] == now["vllm:spec_decode_num_accepted_tokens_total"]


def test_a_bad_draft_cap_is_a_400(server) -> None:  # noqa: ANN001
    resp = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "n_draft": -1},
        timeout=60,
    )
    assert resp.status_code == 400 and "n_draft" in resp.text


def test_llama_cpp_flag_spellings() -> None:
    from cli.main import build_settings, make_parser

    args = make_parser().parse_args(
        ["serve", "--spec-type", "ngram-simple", "--spec-draft-n-max", "6", "--draft-min", "2"]
    )
    s = build_settings(args)
    assert (s.spec_type, s.draft_max, s.draft_min) == ("ngram-simple", 6, 2)
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--spec-draft-n-max"])
    # llama.cpp's comma-separated list; a draft model joins the lookup unless the type is none
    both = ["--spec-type", "ngram-simple,draft-simple", "--model-draft", "d.gguf"]
    assert build_settings(make_parser().parse_args(["serve", *both])).spec_kind == "ngram,draft"
    for spec, kind in (("ngram", "ngram,draft"), ("none", "none"), ("draft", "draft")):
        args = make_parser().parse_args(["serve", "--spec-type", spec, "-md", "d.gguf"])
        assert build_settings(args).spec_kind == kind
    with pytest.raises(ValueError, match="ngram-cache"):
        build_settings(make_parser().parse_args(["serve", "--spec-type", "ngram,ngram-cache"]))


def start_pair(tmp_path, **settings: object):  # noqa: ANN001, ANN201
    """A server of a tiny random Llama with a one-layer one (the same tokenizer) as its draft."""
    target = write_tiny_llama(tmp_path / "target", seed=0)
    draft = write_tiny_llama(tmp_path / "draft", n_layers=1, seed=3)
    return start_server(model=str(target), n_cells=1024, model_draft=str(draft), **settings)


def test_a_draft_model_gives_the_same_text(tmp_path) -> None:  # noqa: ANN001
    live = start_pair(tmp_path)
    try:
        spec = complete(live.url)
        plain = complete(live.url, speculative=False)
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
        assert scrape(live.url)["vllm:spec_decode_num_drafts_total"] > 0
    finally:
        live.stop()


def test_a_draft_over_part_of_the_vocabulary(tmp_path) -> None:  # noqa: ANN001
    """`--draft-vocab N`: the draft's head scores ids below N and the asking sequences' own
    ids only, it never proposes another, and the text is still the plain text (the target
    verifies every draft)."""
    from cli.main import build_settings, make_parser

    args = make_parser().parse_args(["serve", "--draft-vocab", "32768", "-md", "d.gguf"])
    assert build_settings(args).draft_vocab == 32768
    # batch-invariant: other verification row counts than plain decoding's
    live = start_pair(tmp_path, draft_vocab=200, batch_invariant=True)
    try:
        drafter = live.app.state.backend.engine.scheduler.spec.drafter
        assert drafter.vocab_limit > 200
        proposed: list[int] = []
        outside: list[int] = []  # proposed ids neither below 200 nor in the asking sequences
        propose = drafter.propose

        def spy(asks, live_ids):  # noqa: ANN001, ANN202
            out = propose(asks, live_ids)
            own = {t for _, tokens, _ in asks for t in tokens}
            proposed.extend(t for tokens in out for t in tokens)
            outside.extend(t for tokens in out for t in tokens if t >= 200 and t not in own)
            return out

        drafter.propose = spy
        spec = complete(live.url, max_tokens=80)
        plain = complete(live.url, max_tokens=80, speculative=False)
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
        assert proposed and not outside
        assert any(t >= 200 for t in proposed)  # the sequence's own ids: scored on demand
        assert drafter.worker.model.output.rows.weight.shape[0] == 200
    finally:
        live.stop()


def test_a_hybrid_model_as_the_draft(tmp_path) -> None:  # noqa: ANN001
    """A Granite 4.0-H-shaped draft (Mamba2 and attention layers, the target's tokenizer):
    its memory has state slots for twice the seq ids (scheduler.draft.draft_memory), the worker
    as many, and the text is the plain text."""
    from tests.tiny_ssm import write_tiny_granite_hybrid

    target = write_tiny_llama(tmp_path / "target", seed=0)
    draft = write_tiny_granite_hybrid(tmp_path / "draft", seed=3)
    live = start_server(model=str(target), n_cells=1024, n_seq_max=4, model_draft=str(draft))
    try:
        spec = complete(live.url)
        plain = complete(live.url, speculative=False)
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
        assert scrape(live.url)["vllm:spec_decode_num_drafts_total"] > 0
        drafter = live.app.state.backend.engine.scheduler.spec.drafter
        assert drafter.n_seq == 4 and drafter.memory.n_seq_max == 8
        slots = drafter.memory.recr.slots.n_cells
        assert drafter.worker.state.n_slots == slots == 16  # not --n-cells of them
    finally:
        live.stop()


def test_the_lookup_and_a_draft_model_together(tmp_path) -> None:  # noqa: ANN001
    """`--spec-type ngram --model-draft`: both propose (the lookup first), the text is the
    plain text, and /metrics splits the drafted tokens by proposer. Batch-invariant: the
    second request (a prefix-cache hit) verifies other row counts than the first, and without
    it this random model's near-ties round apart (its text then parts from plain decoding's,
    as in any mode: scheduler/speculative.py's NOTE)."""
    live = start_pair(tmp_path, spec_type="ngram", batch_invariant=True)
    try:
        texts = [complete(live.url, max_tokens=80)["choices"][0]["text"] for _ in range(2)]
        plain = complete(live.url, max_tokens=80, speculative=False)["choices"][0]["text"]
        assert texts == [plain, plain]
        metrics = httpx.get(f"{live.url}/metrics").text
        by: dict[str, float] = {}
        for line in metrics.splitlines():
            if line.startswith("cellserve_spec_decode_source_num_draft_tokens_total{"):
                by[line.split('source="')[1].split('"')[0]] = float(line.split()[-1])
        assert set(by) == {"ngram", "draft"} and by["draft"] > 0
        total = scrape(live.url)["vllm:spec_decode_num_draft_tokens_total"]
        assert sum(by.values()) == total
    finally:
        live.stop()


def test_a_draft_with_another_tokenizer_fails_the_start_with_the_reason(tmp_path) -> None:  # noqa: ANN001
    target = write_tiny_llama(tmp_path / "target")
    other = write_tiny_llama(tmp_path / "fim", fim=True)
    with pytest.raises(RuntimeError, match="--model-draft .*must share a tokenizer"):
        start_server(model=str(target), n_cells=512, model_draft=str(other))
