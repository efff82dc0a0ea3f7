"""bench.pair_bench against two fake servers of known speed: the rounds alternate which server goes
first, send both the same prompts within a round and new ones the next, and the ratios are each
round's cellserve p50 over llama.cpp's."""

from __future__ import annotations

import pytest

from bench.pair_bench import run_pairs, summarize, table
from bench.server_proc import Served
from tests.bench.fake_openai import FakeOptions, serve_fake


def test_rounds_alternate_and_send_both_servers_the_same_prompts() -> None:
    fast, slow = FakeOptions(chunk_delay_s=0.01), FakeOptions(chunk_delay_s=0.03)
    with serve_fake(fast) as fast_url, serve_fake(slow) as slow_url:
        servers = {"cellserve": Served(fast_url, 0.0, []), "llama.cpp": Served(slow_url, 0.0, [])}
        rounds = run_pairs(servers, rounds=3, num_prompts=2, input_len=24, output_len=6, max_s=30)
    assert [r["first"] for r in rounds] == ["cellserve", "llama.cpp", "cellserve"]
    # the warm-up (one request each), then 2 a round; the same prompts to both in a round
    fast_prompts = [b["prompt"] for b in fast.bodies[1:]]
    slow_prompts = [b["prompt"] for b in slow.bodies[1:]]
    assert len(fast_prompts) == 6 and fast_prompts == slow_prompts
    assert fast_prompts[0:2] != fast_prompts[2:4]  # a new seed a round
    summary = summarize(rounds)
    itl = summary["itl_ms"]
    assert len(itl["ratios"]) == 3
    for ratio in itl["ratios"]:
        assert ratio == pytest.approx(1 / 3, rel=0.5)
    assert itl["min_ratio"] <= itl["median_ratio"] <= itl["max_ratio"]
    assert summary["cellserve"]["median_itl_ms_p50"] < summary["llama.cpp"]["median_itl_ms_p50"]
    assert "median" in table(rounds, summary)


def test_a_round_where_a_server_completed_nothing_has_no_ratio() -> None:
    level = {
        "num_completed": 1,
        "output_throughput": 10.0,
        **{s: {"p50": 20.0} for s in ("itl_ms", "ttft_ms", "tpot_ms")},
    }
    failed = {**level, "num_completed": 0}
    rounds = [
        {"first": "cellserve", "cellserve": level, "llama.cpp": {**level, "itl_ms": {"p50": 40.0}}},
        {"first": "llama.cpp", "cellserve": failed, "llama.cpp": level},
    ]
    summary = summarize(rounds)
    assert summary["itl_ms"]["ratios"] == [0.5]
    assert summary["ttft_ms"]["ratios"] == [1.0]
