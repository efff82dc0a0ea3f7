"""bench/gemma_bench's memory arithmetic (no model) and its place in bench/run.py."""

from __future__ import annotations

from bench import run as bench_run
from bench.gemma_bench import full_spec, kv_bytes_per_seq
from kvcache.spec import Attention, MemorySpec
from model.arch import gemma3
from model.load.packaged import gemma3_installed

GEMMA3_270M = MemorySpec.of([Attention(1, 256, w) for w in gemma3.windows(18, 512)])


def test_full_cache_keeps_every_token_of_every_layer():
    # 18 layers x K and V x 2,000 tokens x 256 dims x 2 bytes (bfloat16)
    assert kv_bytes_per_seq(full_spec(GEMMA3_270M), 2000, 2) == 18 * 2 * 2000 * 256 * 2


def test_sliding_layers_keep_the_window_and_one_step():
    got = kv_bytes_per_seq(GEMMA3_270M, 2000, 2, step=512)
    assert got == (3 * 2000 + 15 * (512 + 512)) * 2 * 256 * 2
    assert kv_bytes_per_seq(GEMMA3_270M, 300, 2, step=512) == 18 * 300 * 2 * 256 * 2


def test_run_py_runs_the_gemma_bench_exactly_when_installed():
    assert ("gemma_bench" in bench_run.micro_benches()) == gemma3_installed()
