"""bench/recurrent_spec_bench at toy sizes: a verifying step of k drafts per model, rolled back
after each step (no timing asserted: the state and cells it leaves are)."""

from __future__ import annotations

import json

from bench import run as bench_run
from bench.recurrent_bench import Sizes
from bench.recurrent_spec_bench import run

TOY = Sizes(mamba=(64, 2, 8, 16, 16), hybrid=(64, 8, 8, 16, 16), vocab=512)


def test_each_model_gets_a_cost_per_draft_count(tmp_path):
    report = run(tmp_path, TOY, dtype="float32", quant="none", ks=(0, 2, 5), context=40, steps=2)
    saved = json.loads((tmp_path / "recurrent_spec_bench.json").read_text())
    assert saved["costs"] == report["costs"]
    rows = {(r["model"], r["k"]): r for r in report["costs"]}
    assert set(rows) == {(m, k) for m in ("mamba2", "hybrid", "smollm2-135m") for k in (0, 2, 5)}
    for (model, _), r in rows.items():
        assert r["verify_ms"] > 0 and r["chunk_ms"] > 0
        decode = rows[(model, 0)]["verify_ms"]
        assert r["break_even"] == r["verify_ms"] / decode - 1
    assert rows[("mamba2", 0)]["break_even"] == 0


def test_run_py_runs_it():
    assert "recurrent_spec_bench" in bench_run.micro_benches()
