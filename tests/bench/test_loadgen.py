from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from bench.loadgen import CUT_OFF, LoadConfig, run_load
from bench.metrics import compute_metrics
from bench.workloads import PromptBuilder, Session, WorkloadSpec, build_sessions
from tests.bench.fake_openai import CHUNK_TEXT, FakeOptions, serve_fake

DELAY_S = 0.01


def make_sessions(n: int, spec_name: str = "random", input_len: int = 12, turns: int = 1):
    spec = WorkloadSpec(spec_name, n, input_len=input_len, prefix_len=40, turns=turns)
    return build_sessions(spec, PromptBuilder(random.Random(0), lambda t: len(t.split())))


def make_config(url: str, output_len: int = 6, endpoint: str = "completions") -> LoadConfig:
    return LoadConfig(base_url=url, model="fake-model", endpoint=endpoint, output_len=output_len)


def load(cfg: LoadConfig, sessions: list[Session], concurrency: int | None = 3, rate=None):
    rate = float("inf") if rate is None else rate
    return asyncio.run(run_load(cfg, sessions, concurrency, rate, seed=0, progress=False))


def test_counts_completed_and_failed_requests() -> None:
    opts = FakeOptions(chunk_delay_s=DELAY_S, fail_every=3)
    with serve_fake(opts) as url:
        result = load(make_config(url), make_sessions(9))
    metrics = compute_metrics(result.results, result.duration_s)
    assert (metrics.num_completed, metrics.num_failed) == (6, 3)
    assert metrics.errors and metrics.errors[0].startswith("HTTP 500")
    assert metrics.total_output_tokens == 6 * 6


def test_an_error_event_inside_the_stream_fails_the_request() -> None:
    opts = FakeOptions(chunk_delay_s=DELAY_S, fail_every=2, fail_mode="stream")
    with serve_fake(opts) as url:
        result = load(make_config(url), make_sessions(4))
    metrics = compute_metrics(result.results, result.duration_s)
    assert (metrics.num_completed, metrics.num_failed) == (2, 2)
    assert metrics.errors[0].startswith("stream error")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_timings_follow_the_stream(endpoint: str) -> None:
    with serve_fake(FakeOptions(chunk_delay_s=DELAY_S)) as url:
        result = load(make_config(url, output_len=5, endpoint=endpoint), make_sessions(3))
    assert [r.success for r in result.results] == [True] * 3
    for r in result.results:
        assert r.num_output_tokens == 5
        assert r.num_prompt_tokens == 12  # from the usage chunk: the fake counts words
        assert len(r.itl) == 4  # one gap per text chunk after the first
        # the fake sleeps before every chunk (single gaps jitter; the totals cannot shrink)
        assert r.ttft >= DELAY_S * 0.5
        assert r.latency >= 4 * DELAY_S
        assert r.latency == pytest.approx(r.ttft + sum(r.itl))
        assert r.tpot == pytest.approx(sum(r.itl) / 4)


def test_output_tokens_come_from_usage_when_the_stream_has_it() -> None:
    # 3 tokens per chunk: 4 chunks for max_tokens=12
    with serve_fake(FakeOptions(chunk_delay_s=DELAY_S, tokens_per_chunk=3)) as url:
        result = load(make_config(url, output_len=12), make_sessions(2))
    assert [r.num_output_tokens for r in result.results] == [12, 12]
    assert [len(r.itl) for r in result.results] == [3, 3]


def test_without_usage_the_chunks_are_counted() -> None:
    opts = FakeOptions(chunk_delay_s=DELAY_S, tokens_per_chunk=3, usage=False)
    with serve_fake(opts) as url:
        result = load(make_config(url, output_len=12), make_sessions(2))
    assert [r.num_output_tokens for r in result.results] == [4, 4]
    assert [r.num_prompt_tokens for r in result.results] == [12, 12]  # the calibrated guess


def test_requests_carry_the_benchmark_options() -> None:
    opts = FakeOptions(chunk_delay_s=0.0)
    with serve_fake(opts) as url:
        load(make_config(url, output_len=7), make_sessions(2))
    for body in opts.bodies:
        assert body["stream"] is True and body["ignore_eos"] is True
        assert body["max_tokens"] == 7 and body["temperature"] == 0.0
        assert body["stream_options"] == {"include_usage": True}
        assert body["model"] == "fake-model"


def test_multi_turn_resends_the_growing_history() -> None:
    opts = FakeOptions(chunk_delay_s=0.0)
    sessions = make_sessions(2, "multi-turn", input_len=5, turns=3)
    with serve_fake(opts) as url:
        result = load(make_config(url, output_len=4, endpoint="chat"), sessions, concurrency=1)
    assert len(result.results) == 6 and all(r.success for r in result.results)
    message_counts = [len(body["messages"]) for body in opts.bodies]
    assert message_counts == [1, 3, 5, 1, 3, 5]
    last = opts.bodies[2]["messages"]
    assert last[1] == {"role": "assistant", "content": CHUNK_TEXT * 4}
    assert [m["content"] for m in last if m["role"] == "user"] == sessions[0].user_turns
    # prompt tokens of turn 3: 3 user turns of 5 words + 2 replies of 4 words
    assert result.results[2].num_prompt_tokens == 3 * 5 + 2 * 4


def test_shared_prefix_sends_the_system_prompt_first() -> None:
    opts = FakeOptions(chunk_delay_s=0.0)
    sessions = make_sessions(3, "shared-prefix", input_len=6)
    with serve_fake(opts) as url:
        load(make_config(url, output_len=2), sessions)
    prompts = [body["prompt"] for body in opts.bodies]
    assert all(p.startswith(sessions[0].system + "\n\n") for p in prompts)
    assert len(set(prompts)) == 3


def test_poisson_load_without_a_concurrency_cap() -> None:
    with serve_fake(FakeOptions(chunk_delay_s=0.0)) as url:
        result = load(make_config(url, output_len=2), make_sessions(5), None, rate=50.0)
    assert len(result.results) == 5 and all(r.success for r in result.results)


def test_no_session_starts_after_the_time_limit() -> None:
    cfg = make_config("http://127.0.0.1:9", output_len=2)
    cfg.max_duration_s = 1e-9
    result = load(cfg, make_sessions(4), concurrency=1)
    assert result.num_skipped >= 3
    assert len(result.results) + result.num_skipped == 4


def test_an_unreachable_server_fails_every_request() -> None:
    cfg = make_config("http://127.0.0.1:9/v1", output_len=2)
    result = load(cfg, make_sessions(3))
    assert [r.success for r in result.results] == [False] * 3
    assert all("Connect" in r.error for r in result.results)
    with pytest.raises(httpx.ConnectError):
        httpx.get("http://127.0.0.1:9", trust_env=False)


def test_requests_running_at_the_cutoff_fail_and_the_rest_are_skipped() -> None:
    with serve_fake(FakeOptions(chunk_delay_s=0.05)) as url:
        cfg = make_config(url, output_len=200)  # ~10 s per request without the cutoff
        cfg.cutoff_s = 0.5
        result = load(cfg, make_sessions(5), concurrency=2)
    assert [r.error for r in result.results] == [CUT_OFF, CUT_OFF]
    assert result.num_skipped == 3
    assert result.duration_s < 5
