from __future__ import annotations

import json
import pathlib

import pytest

from bench.cli import main
from bench.report import format_table
from tests.bench.fake_openai import MODEL_ID, FakeOptions, serve_fake

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(url: str, out: pathlib.Path, *extra: str) -> int:
    args = ["--base-url", url, "--num-prompts", "4", "--input-len", "16", "--output-len", "5"]
    return main([*args, "--no-progress", "--out", str(out), *extra])


def test_sweep_writes_json_and_png(tmp_path: pathlib.Path, capsys) -> None:
    opts = FakeOptions(chunk_delay_s=0.002)
    with serve_fake(opts) as url:
        rc = run_cli(url, tmp_path, "--concurrency", "1,2", "--slo", "ttft=5,tpot=5")
    assert rc == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["model"] == MODEL_ID  # from GET /v1/models
    assert results["prompt_lengths"] == "calibrated with /tokenize"
    assert [lv["concurrency"] for lv in results["levels"]] == [1, 2]
    for level in results["levels"]:
        assert (level["num_completed"], level["num_failed"]) == (4, 0)
        assert level["total_input_tokens"] == 4 * 16
        assert level["total_output_tokens"] == 4 * 5
        assert level["goodput"] == pytest.approx(level["request_throughput"])
    assert (tmp_path / "results.png").read_bytes()[:8] == PNG_MAGIC
    out = capsys.readouterr().out
    assert "TTFT p99 ms" in out and "c=1" in out and "c=2" in out
    # warm-up + 2 levels x 4 prompts; each level gets fresh prompts
    prompts = [body["prompt"] for body in opts.bodies]
    assert len(prompts) == 9 and len(set(prompts)) == 9


def test_multi_turn_defaults_to_the_chat_endpoint(tmp_path: pathlib.Path) -> None:
    opts = FakeOptions(chunk_delay_s=0.0)
    with serve_fake(opts) as url:
        rc = run_cli(url, tmp_path, "--workload", "multi-turn", "--turns", "2", "--no-warmup")
    assert rc == 0
    assert all("messages" in body for body in opts.bodies) and len(opts.bodies) == 8
    level = json.loads((tmp_path / "results.json").read_text())["levels"][0]
    assert level["concurrency"] == 8 and level["num_completed"] == 8


def test_without_tokenize_the_lengths_are_approximate(tmp_path: pathlib.Path) -> None:
    with serve_fake(FakeOptions(chunk_delay_s=0.0, tokenize=False)) as url:
        rc = run_cli(url, tmp_path, "--request-rate", "100")
    results = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0 and results["prompt_lengths"] == "approximate"
    assert results["levels"][0]["concurrency"] is None
    assert results["levels"][0]["request_rate"] == 100.0


def test_all_requests_failing_is_an_error_exit(tmp_path: pathlib.Path) -> None:
    with serve_fake(FakeOptions(chunk_delay_s=0.0, fail_every=1)) as url:
        rc = run_cli(url, tmp_path, "--concurrency", "2", "--no-warmup")
    level = json.loads((tmp_path / "results.json").read_text())["levels"][0]
    assert rc == 1 and (level["num_completed"], level["num_failed"]) == (0, 4)


def test_table_has_one_column_per_level() -> None:
    summary = {"mean": 1.0, "p50": 1.0, "p90": 2.0, "p99": 3.0}
    level = {
        "concurrency": 4, "request_rate": None, "num_completed": 3, "num_failed": 1,
        "duration_s": 2.0, "request_throughput": 1.5, "output_throughput": 10.0,
        "total_token_throughput": 30.0, "goodput": None, "ttft_ms": summary,
        "tpot_ms": summary, "itl_ms": summary, "e2el_ms": summary,
    }  # fmt: skip
    table = format_table([level, {**level, "concurrency": 16}]).splitlines()
    assert table[0].split() == ["c=4", "c=16"]
    assert table[1].split() == ["completed/failed", "3/1", "3/1"]
    assert "goodput req/s - -" in " ".join(" ".join(t.split()) for t in table)
