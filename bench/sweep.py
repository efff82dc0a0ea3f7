"""The serving workloads `python -m bench.run` sends (bench/run.py orchestrates them): the sizes,
the time they may take, a random-prompt sweep over concurrency levels and the shared-prefix
workload, against any OpenAI-compatible server at a URL."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from bench.cli import run_benchmark
from bench.loadgen import LoadConfig
from bench.workloads import WorkloadSpec


@dataclass(slots=True)
class Sizes:
    input_len: int
    output_len: int
    concurrencies: tuple[int, ...]
    level_max_s: float  # no new request after this; running ones are cut at 1.5x
    prefix_len: int
    prefix_input_len: int
    prefix_output_len: int
    prefix_concurrency: int
    prefix_num_prompts: int
    prefix_max_s: float

    def num_prompts(self, concurrency: int) -> int:
        return min(max(4, 2 * concurrency), 32)


FULL = Sizes(256, 128, (1, 8, 32), 150.0, 1000, 32, 16, 4, 12, 120.0)
QUICK = Sizes(128, 32, (1, 4), 60.0, 512, 16, 8, 2, 6, 60.0)


class Clock:
    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()


def load_config(url: str, output_len: int, max_s: float) -> LoadConfig:
    return LoadConfig(
        base_url=url,
        model="",
        output_len=output_len,
        timeout_s=max(max_s * 2, 60.0),
        max_duration_s=max_s,
        cutoff_s=max_s * 1.5,
    )


def run_sweep(url: str, sizes: Sizes, clock: Clock) -> dict[str, Any]:
    """Random prompts, one level per concurrency; each level's time shrinks to fit `clock`."""
    results: dict[str, Any] = {"levels": [], "skipped_levels": []}
    for idx, concurrency in enumerate(sizes.concurrencies):
        n_left = len(sizes.concurrencies) - idx
        max_s = min(sizes.level_max_s, clock.left() / n_left / 1.5)
        if max_s < 5:
            results["skipped_levels"].append(concurrency)
            continue
        spec = WorkloadSpec("random", sizes.num_prompts(concurrency), sizes.input_len)
        cfg = load_config(url, sizes.output_len, max_s)
        level = run_benchmark(cfg, spec, [concurrency], seed=idx, warmup=idx == 0)
        results = {
            **level,
            "levels": results["levels"] + level["levels"],
            "skipped_levels": results["skipped_levels"],
        }
    return results


def run_prefix(url: str, sizes: Sizes, budget_s: float) -> dict[str, Any]:
    """The shared-prefix workload with the same prompts (same seed) on any server."""
    max_s = min(sizes.prefix_max_s, max(budget_s / 1.5, 10.0))
    spec = WorkloadSpec(
        "shared-prefix", sizes.prefix_num_prompts, sizes.prefix_input_len, sizes.prefix_len
    )
    cfg = load_config(url, sizes.prefix_output_len, max_s)
    return run_benchmark(cfg, spec, [sizes.prefix_concurrency], seed=0)


def ttft_ratio(on: dict[str, Any], off: dict[str, Any]) -> dict[str, float | None]:
    """TTFT without the prefix cache over TTFT with it (> 1: the cache helps)."""
    out: dict[str, float | None] = {}
    for stat in ("mean", "p50", "p99"):
        with_cache = on["levels"][0]["ttft_ms"][stat]
        without = off["levels"][0]["ttft_ms"][stat]
        out[stat] = without / with_cache if with_cache > 0 else None
    return out


def sweep_budget_s(sizes: Sizes, clock: Clock, share: float) -> float:
    """Seconds for one sweep: `share` of what is left, at most what its levels can use."""
    most = len(sizes.concurrencies) * sizes.level_max_s * 1.5 + 30.0
    return min(share * clock.left(), most)
