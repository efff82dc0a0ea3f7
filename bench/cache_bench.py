"""`python -m bench.cache_bench`: KVCells hot paths at 65,536 cells and 256 sequences.

The cache is set up like a busy server: a 2,000-token prefix owned by seq 0 and every
sequence holding ~200 cells of its own (positions after the prefix), cells interleaved
the way round-robin decoding leaves them. Each operation is timed on its own; the state
it changes is restored outside the timed region.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvcache.cells import KVCells

N_CELLS = 65_536
N_SEQ = 256
PREFIX = 2_000
OWN = 200


def make_busy_cache() -> KVCells:
    kv = KVCells(N_CELLS, N_SEQ)
    kv.apply_ubatch(np.arange(PREFIX), np.arange(PREFIX), np.zeros(PREFIX, dtype=np.int64))
    for step in range(OWN):  # decode-like: one token per seq per step
        cells = kv.find_slot(N_SEQ)
        assert cells is not None
        kv.apply_ubatch(cells, np.full(N_SEQ, PREFIX + step), np.arange(N_SEQ))
    kv.check()
    return kv


def timed(op: Callable[[int], object], restore: Callable[[int], None], n: int) -> dict[str, float]:
    times = np.empty(n)
    for i in range(n):
        start = time.perf_counter()
        op(i)
        times[i] = time.perf_counter() - start
        restore(i)
    mean = float(times.mean())
    return {
        "mean_us": mean * 1e6,
        "median_us": float(np.median(times)) * 1e6,
        "ops_per_s": 1.0 / mean,
        "n": n,
    }


def bench_prefill(kv: KVCells, n: int) -> dict[str, float]:
    seq = N_SEQ - 1
    base = kv.seq_pos_max(seq) + 1

    def op(_: int) -> None:
        cells = kv.find_slot(512)
        assert cells is not None
        kv.apply_ubatch(cells, np.arange(base, base + 512), np.full(512, seq))

    return timed(op, lambda _: kv.seq_rm(seq, base, -1), n)


def bench_decode(kv: KVCells, n: int) -> dict[str, float]:
    seqs = np.arange(N_SEQ)
    base = np.array([kv.seq_pos_max(s) + 1 for s in range(N_SEQ)])

    def op(_: int) -> None:
        cells = kv.find_slot(N_SEQ)
        assert cells is not None
        kv.apply_ubatch(cells, base, seqs)

    def restore(_: int) -> None:
        kv.seq_rm(-1, int(base[0]), -1)

    return timed(op, restore, n)


def bench_seq_cp(kv: KVCells, n: int) -> dict[str, float]:
    def op(i: int) -> None:
        kv.seq_cp(0, 1 + i % (N_SEQ - 1), 0, PREFIX)

    return timed(op, lambda i: kv.seq_rm(1 + i % (N_SEQ - 1), 0, PREFIX), n)


def bench_seq_rm(kv: KVCells, n: int) -> dict[str, float]:
    saved = {seq: kv.seq_cells(seq) for seq in range(1, N_SEQ)}

    def restore(i: int) -> None:
        seq = 1 + i % (N_SEQ - 1)
        cells, positions = saved[seq]
        kv.apply_ubatch(cells, positions, np.full(cells.size, seq))

    return timed(lambda i: kv.seq_rm(1 + i % (N_SEQ - 1), -1, -1), restore, n)


def bench_pos_max_all(kv: KVCells, n: int) -> dict[str, float]:
    def op(_: int) -> None:
        for s in range(N_SEQ):
            kv.seq_pos_max(s)

    return timed(op, lambda _: None, n)


def bench_shared_shift(kv: KVCells, n: int) -> dict[str, float]:
    """Context shift of a seq that shares the 2,000-token prefix: seq_rm + seq_add with
    copy-on-write of the prefix tail (1,000 copies), then take_pending."""
    seq = N_SEQ - 1
    kv.seq_cp(0, seq, 0, PREFIX)
    saved = kv.seq_cells(seq)

    def op(_: int) -> None:
        kv.seq_rm(seq, 500, 1000)
        kv.seq_add(seq, 1000, -1, -500)
        kv.take_pending()

    def restore(_: int) -> None:
        kv.seq_rm(seq, -1, -1)
        mine = saved[1] >= PREFIX
        kv.apply_ubatch(saved[0][mine], saved[1][mine], np.full(int(mine.sum()), seq))
        kv.seq_cp(0, seq, 0, PREFIX)

    result = timed(op, restore, n)
    kv.seq_rm(seq, 0, PREFIX)
    return result


def run(out_dir: pathlib.Path | None = None, n: int = 200) -> dict[str, Any]:
    kv = make_busy_cache()
    results: dict[str, Any] = {
        "n_cells": N_CELLS,
        "n_seq_max": N_SEQ,
        "used": kv.used,
        "prefill_512 (find_slot+apply_ubatch)": bench_prefill(kv, n),
        "decode_256 (find_slot+apply_ubatch)": bench_decode(kv, n),
        "seq_cp prefix 2000": bench_seq_cp(kv, n),
        "seq_rm whole seq": bench_seq_rm(kv, n),
        "seq_pos_max x256": bench_pos_max_all(kv, n),
        "owner_map": timed(lambda _: kv.owner_map(), lambda _: None, n),
        "stats": timed(lambda _: kv.stats(), lambda _: None, n),
        "context shift, shared prefix (CoW)": bench_shared_shift(kv, n),
    }
    kv.check()
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "cache_bench.json").write_text(json.dumps(results, indent=2))
    return results


def main() -> None:
    results = run()
    print(
        f"KVCells: {results['n_cells']} cells, {results['n_seq_max']} seqs, used {results['used']}"
    )
    for name, r in results.items():
        if isinstance(r, dict):
            print(
                f"  {name:38s} mean {r['mean_us']:8.1f} us  median {r['median_us']:8.1f} us"
                f"  {r['ops_per_s']:8.0f} ops/s"
            )


if __name__ == "__main__":
    main()
