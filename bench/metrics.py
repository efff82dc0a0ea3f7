"""Client-side serving metrics, computed the way `vllm bench serve` does.

Per request the client records, against its own clock:
- TTFT: first chunk that carries output text, minus the send time;
- ITL: the gap between consecutive output chunks (one entry per chunk after the first);
- E2EL: the last output chunk minus the send time;
- TPOT: (E2EL - TTFT) / (output tokens - 1), defined when a request produced >= 2 tokens.
Goodput counts the requests that meet every SLO, per second of benchmark duration.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "itl", "e2el")


@dataclass(slots=True)
class RequestResult:
    success: bool
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, send -> last output chunk
    itl: list[float] = field(default_factory=list)  # seconds, one per chunk after the first
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class Summary:
    """Milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float


@dataclass(slots=True)
class BenchMetrics:
    num_completed: int
    num_failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    goodput: float | None  # requests meeting every SLO / s; None without SLOs
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    e2el_ms: Summary
    errors: list[str]  # up to 5 distinct messages

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize_ms(values_s: list[float]) -> Summary:
    """Mean and linear-interpolated percentiles (numpy's default), in ms; zeros when empty."""
    if not values_s:
        return Summary(0.0, 0.0, 0.0, 0.0)
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = (float(np.percentile(ms, p)) for p in PERCENTILES)
    return Summary(float(ms.mean()), p50, p90, p99)


def parse_slo(text: str) -> dict[str, float]:
    """'ttft=0.5,tpot=0.05' -> {'ttft': 0.5, 'tpot': 0.05} (seconds)."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO {part!r}: expected one of {SLO_KEYS} as key=seconds")
        seconds = float(value)
        if seconds <= 0:
            raise ValueError(f"SLO {key} must be positive, got {seconds}")
        slo[key] = seconds
    return slo


def meets_slo(result: RequestResult, slo: dict[str, float]) -> bool:
    """A request is good when it succeeded and every measured value is within its SLO."""
    if not result.success:
        return False
    measured = {
        "ttft": result.ttft,
        "tpot": result.tpot or 0.0,
        "itl": max(result.itl, default=0.0),
        "e2el": result.latency,
    }
    return all(measured[key] <= limit for key, limit in slo.items())


def compute_metrics(
    results: list[RequestResult], duration_s: float, slo: dict[str, float] | None = None
) -> BenchMetrics:
    done = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    duration = max(duration_s, 1e-9)
    n_in = sum(r.num_prompt_tokens for r in done)
    n_out = sum(r.num_output_tokens for r in done)
    tpots = [t for r in done if (t := r.tpot) is not None]
    goodput = None
    if slo:
        goodput = sum(meets_slo(r, slo) for r in done) / duration
    errors = list(dict.fromkeys(r.error for r in failed))[:5]
    return BenchMetrics(
        num_completed=len(done),
        num_failed=len(failed),
        duration_s=duration_s,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=len(done) / duration,
        output_throughput=n_out / duration,
        total_token_throughput=(n_in + n_out) / duration,
        goodput=goodput,
        ttft_ms=summarize_ms([r.ttft for r in done]),
        tpot_ms=summarize_ms(tpots),
        itl_ms=summarize_ms([gap for r in done for gap in r.itl]),
        e2el_ms=summarize_ms([r.latency for r in done]),
        errors=errors,
    )
