from __future__ import annotations

import math

import numpy as np
import pytest

from bench.loadgen import arrival_intervals
from bench.metrics import RequestResult, compute_metrics, meets_slo, parse_slo, summarize_ms


def make_result(
    ttft: float, itl: list[float], n_out: int | None = None, n_prompt: int = 10
) -> RequestResult:
    """A successful request whose chunks arrived at ttft, then after each gap in itl."""
    return RequestResult(
        success=True,
        ttft=ttft,
        latency=ttft + sum(itl),
        itl=list(itl),
        num_prompt_tokens=n_prompt,
        num_output_tokens=len(itl) + 1 if n_out is None else n_out,
    )


def make_failure(error: str = "HTTP 500: boom") -> RequestResult:
    return RequestResult(success=False, error=error)


def test_tpot_excludes_the_first_token() -> None:
    result = make_result(ttft=0.2, itl=[0.1, 0.1, 0.1, 0.1])
    assert result.num_output_tokens == 5
    assert result.tpot == pytest.approx(0.1)


def test_tpot_uses_token_counts_not_chunks() -> None:
    # 2 chunks carrying 9 tokens: (latency - ttft) / (9 - 1)
    result = make_result(ttft=0.5, itl=[0.8], n_out=9)
    assert result.tpot == pytest.approx(0.1)


def test_tpot_undefined_below_two_tokens() -> None:
    assert make_result(ttft=0.3, itl=[], n_out=1).tpot is None


def test_summary_is_linear_interpolated_percentiles_in_ms() -> None:
    s = summarize_ms([0.001, 0.002, 0.003, 0.004])
    assert s.mean == pytest.approx(2.5)
    assert s.p50 == pytest.approx(2.5)
    assert s.p90 == pytest.approx(3.7)
    assert s.p99 == pytest.approx(3.97)


def test_summary_of_nothing_is_zero() -> None:
    s = summarize_ms([])
    assert (s.mean, s.p50, s.p90, s.p99) == (0.0, 0.0, 0.0, 0.0)


def test_compute_metrics_counts_and_throughputs() -> None:
    results = [
        make_result(ttft=0.1, itl=[0.05] * 3, n_prompt=100),  # 4 tokens
        make_result(ttft=0.3, itl=[0.05] * 7, n_prompt=100),  # 8 tokens
        make_failure("HTTP 500: boom"),
        make_failure("HTTP 500: boom"),
        make_failure("ReadTimeout: "),
    ]
    m = compute_metrics(results, duration_s=4.0)
    assert (m.num_completed, m.num_failed) == (2, 3)
    assert (m.total_input_tokens, m.total_output_tokens) == (200, 12)
    assert m.request_throughput == pytest.approx(0.5)
    assert m.output_throughput == pytest.approx(3.0)
    assert m.total_token_throughput == pytest.approx(53.0)
    assert m.goodput is None
    assert m.errors == ["HTTP 500: boom", "ReadTimeout: "]
    assert m.ttft_ms.mean == pytest.approx(200.0)
    assert m.itl_ms.mean == pytest.approx(50.0)
    assert m.tpot_ms.mean == pytest.approx(50.0)
    assert m.e2el_ms.p50 == pytest.approx((0.25 + 0.65) / 2 * 1000)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    results = [
        make_result(ttft=0.1, itl=[0.01] * 4),  # good
        make_result(ttft=0.9, itl=[0.01] * 4),  # TTFT too slow
        make_result(ttft=0.1, itl=[0.2] * 4),  # TPOT too slow
        make_result(ttft=0.2, itl=[0.04] * 4),  # good
        make_failure(),  # never good
    ]
    slo = parse_slo("ttft=0.5,tpot=0.05")
    assert [meets_slo(r, slo) for r in results] == [True, False, False, True, False]
    assert compute_metrics(results, duration_s=2.0, slo=slo).goodput == pytest.approx(1.0)


def test_e2el_and_itl_slos() -> None:
    result = make_result(ttft=0.1, itl=[0.01, 0.3, 0.01])
    assert meets_slo(result, {"e2el": 0.5})
    assert not meets_slo(result, {"e2el": 0.4})
    assert not meets_slo(result, {"itl": 0.2})


@pytest.mark.parametrize("text", ["ttft", "ttft=0", "latency=1", "tpot=-1"])
def test_parse_slo_rejects_bad_input(text: str) -> None:
    with pytest.raises(ValueError):
        parse_slo(text)


def test_poisson_arrivals_have_the_requested_mean_rate() -> None:
    gaps = arrival_intervals(20_000, 4.0, np.random.default_rng(0))
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    # exponential: the standard deviation equals the mean
    assert gaps.std() == pytest.approx(0.25, rel=0.05)
    again = arrival_intervals(20_000, 4.0, np.random.default_rng(0))
    assert np.array_equal(gaps, again)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert not arrival_intervals(5, math.inf, np.random.default_rng(0)).any()
    with pytest.raises(ValueError):
        arrival_intervals(5, 0.0, np.random.default_rng(0))
