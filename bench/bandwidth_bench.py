"""This machine's memory read bandwidth, STREAM-style: the ceiling of a decode step.

A decode step of one sequence reads every weight once, so its best time is weight bytes /
read bandwidth. `run()` sums a 1 GiB float32 array (8x any cache) with every core, best of
several passes, and reports GB/s; bench/summary.py sets each c=1 figure beside it
(`python -m bench.bandwidth_bench`).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from typing import Any

import torch

SIZE_BYTES = 1 << 30
PASSES = 7


def read_bandwidth(size_bytes: int = SIZE_BYTES, passes: int = PASSES) -> dict[str, Any]:
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    x = torch.ones(size_bytes // 4, dtype=torch.float32)
    x.sum()  # fault the pages in
    times = []
    for _ in range(passes):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    best = min(times)
    return {
        "bytes": x.numel() * 4,
        "threads": threads,
        "best_s": best,
        "read_gbps": x.numel() * 4 / best / 1e9,
        "median_gbps": x.numel() * 4 / sorted(times)[len(times) // 2] / 1e9,
    }


def run(out_dir: pathlib.Path) -> dict[str, Any]:
    result = read_bandwidth()
    (out_dir / "results.json").write_text(json.dumps(result, indent=2))
    print(f"   read bandwidth {result['read_gbps']:.1f} GB/s ({result['threads']} threads)")
    return result


if __name__ == "__main__":
    json.dump(read_bandwidth(), sys.stdout, indent=2)
    print()
