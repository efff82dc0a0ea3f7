"""bench/recurrent_bench at toy sizes: what it measures is what it says (no timing asserted)."""

from __future__ import annotations

import json

from bench import run as bench_run
from bench.recurrent_bench import Sizes, run

TOY = Sizes(
    contexts=(64, 256),
    num_seqs=(1, 2),
    decode_steps=3,
    system_len=300,
    user_len=8,
    mamba=(64, 2, 8, 16, 16),
    hybrid=(64, 8, 8, 16, 16),
    vocab=512,
)


def test_decode_memory_per_sequence_is_flat_for_mamba2_and_grows_with_attention(tmp_path):
    report = run(tmp_path, TOY, dtype="float32", quant="none", threads=1)
    assert json.loads((tmp_path / "recurrent_bench.json").read_text())["decode"] == report["decode"]
    rows = {(r["model"], r["context"], r["num_seqs"]): r for r in report["decode"]}
    assert len(rows) == 2 * 2 * 2
    # Mamba2: 2 layers x (conv (128 + 2 x 16) x 3 + ssm 8 x 16 x 16) float32, at any context
    state = 2 * (160 * 3 + 8 * 16 * 16) * 4
    assert rows[("mamba2", 64, 1)]["bytes_per_seq"] == rows[("mamba2", 256, 2)]["bytes_per_seq"]
    assert rows[("mamba2", 64, 1)]["bytes_per_seq"] == state
    # SmolLM2-135M: 30 layers x K and V x 3 heads x 64 dims x 4 bytes per token
    assert rows[("smollm2-135m", 256, 1)]["bytes_per_seq"] == 256 * 30 * 2 * 3 * 64 * 4
    assert all(r["decode_step_ms"] > 0 for r in rows.values())
    ttft = report["hybrid_prefix_ttft"]
    assert ttft["on"]["cached_tokens"] >= 256 and ttft["off"]["cached_tokens"] == 0


def test_run_py_runs_it():
    assert "recurrent_bench" in bench_run.micro_benches()
