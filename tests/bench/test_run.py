from __future__ import annotations

import pathlib
import shlex
from dataclasses import replace
from typing import Any

import pytest

import bench.server_proc
from bench.run import (
    DEFAULT_SERVER_ARGS,
    build_parser,
    default_budget_s,
    main,
    run_llamacpp,
    run_micro,
)
from bench.server_proc import llamacpp_command, llamacpp_env
from bench.summary import render_summary
from bench.sweep import QUICK, Clock, sweep_budget_s, ttft_ratio


@pytest.fixture
def micro_package(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A throwaway package with one working and one failing micro-benchmark."""
    pkg = tmp_path / "fake_micro_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "works.py").write_text(
        "def run(out_dir):\n"
        "    (out_dir / 'marker.txt').write_text('ran')\n"
        "    return {'tokens_per_s': 12.5, 'detail': {'n': 3}}\n"
    )
    (pkg / "breaks.py").write_text("def run(out_dir):\n    raise RuntimeError('no model')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fake_micro_pkg"


def test_micro_benchmark_results_and_failures_are_recorded(
    micro_package: str, tmp_path: pathlib.Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    ok = run_micro("works", out, package=micro_package)
    assert ok["status"] == "ok" and ok["result"]["tokens_per_s"] == 12.5
    assert (out / "works" / "marker.txt").read_text() == "ran"
    broken = run_micro("breaks", out, package=micro_package)
    assert broken["status"] == "failed" and broken["error"] == "RuntimeError: no model"
    assert "raise RuntimeError" in (out / "breaks.error.txt").read_text()
    assert run_micro("missing", out, package=micro_package) == {"status": "absent"}


def make_level(
    ttft_mean: float, concurrency: int = 4, completed: int = 6, errors: tuple[str, ...] = ()
) -> dict[str, Any]:
    summary = {"mean": ttft_mean, "p50": ttft_mean, "p90": ttft_mean, "p99": 2 * ttft_mean}
    return {
        "concurrency": concurrency, "request_rate": None, "num_completed": completed,
        "num_failed": len(errors), "num_skipped": 0, "duration_s": 10.0, "request_throughput": 0.6,
        "output_throughput": 12.0, "total_token_throughput": 300.0, "goodput": None,
        "ttft_ms": summary, "tpot_ms": summary, "itl_ms": summary, "e2el_ms": summary,
        "errors": list(errors),
    }  # fmt: skip


def make_run(levels: list[dict[str, Any]], name: str = "random") -> dict[str, Any]:
    workload = {"name": name, "input_len": 32, "output_len": 16, "prefix_len": 1000}
    return {"model": "m", "prompt_lengths": "calibrated with /tokenize", "workload": workload,
            "levels": levels}  # fmt: skip


def test_ttft_ratio_is_without_over_with_the_cache() -> None:
    ratio = ttft_ratio(make_run([make_level(100.0)]), make_run([make_level(400.0)]))
    assert ratio == {"mean": 4.0, "p50": 4.0, "p99": 4.0}
    assert ttft_ratio(make_run([make_level(0.0)]), make_run([make_level(1.0)]))["mean"] is None


def test_summary_has_the_sweep_the_prefix_comparison_and_the_micro_results() -> None:
    report = {
        "environment": {"date": "today", "commit": "abc", "cpu_count": 2},
        "micro": {
            "cache_bench": {"status": "ok", "seconds": 1.5, "result": {"ops_per_s": 1000.0}},
            "model_bench": {"status": "failed", "seconds": 0.1, "error": "OSError: x"},
            "engine_bench": {"status": "absent"},
        },
        "serving": {
            "startup_s": 12.0,
            "sweep": {**make_run([make_level(50.0, 1), make_level(80.0, 8, 5, ("cut off",))]),
                      "skipped_levels": [32]},
            "prefix_on": make_run([make_level(100.0)], "shared-prefix"),
            "prefix_off": make_run([make_level(400.0)], "shared-prefix"),
            "prefix_ttft_ratio": {"mean": 4.0, "p50": 4.0, "p99": 4.0},
        },
    }  # fmt: skip
    text = render_summary(report)
    assert "| cache_bench | ok | 1.5 | ops_per_s=1000.000 |" in text
    assert "| model_bench | failed | 0.1 | OSError: x |" in text
    assert "| engine_bench | absent | - |  |" in text
    assert "| 1 | 6/0 | 0.60 | 12.0 | 300.0 | 50.0 / 100.0 |" in text
    assert "| 8 | 5/1 |" in text and "Skipped for time: concurrency [32]" in text
    assert "Failures: c=8: 1 failed (cut off)." in text
    assert "| on | 6/0 |" in text and "| off | 6/0 |" in text
    assert "mean 4.00x" in text


def test_quick_sizes_fit_the_model_context() -> None:
    assert QUICK.prefix_len + QUICK.prefix_input_len + QUICK.prefix_output_len < 2048
    assert [QUICK.num_prompts(c) for c in (1, 4, 32, 64)] == [4, 8, 32, 32]


def test_llamacpp_command_serves_the_gguf_with_32_slots_on_a_32768_cell_context() -> None:
    cmd = llamacpp_command(pathlib.Path("/bin/llama-server"), pathlib.Path("/m/x.gguf"), 8123, 2)
    assert cmd == [
        "/bin/llama-server", "-m", "/m/x.gguf", "-t", "2", "-c", "32768", "-np", "32",
        "--host", "127.0.0.1", "--port", "8123",
    ]  # fmt: skip


def test_llamacpp_runs_without_its_repacking_on_amx_cpus(monkeypatch, tmp_path) -> None:
    """llama.cpp's native build crashed at start-up on an AMX Xeon unless --no-repack: its
    servers get LLAMA_ARG_REPACK=0 there, nowhere else, not for a build without AMX (an
    LLAMA_ISA build, by its BUILD_INFO), and never over the caller's value."""
    native, avx2 = tmp_path / "llama.cpp", tmp_path / "llama.cpp-avx2"
    for prefix, args in ((native, "-DGGML_NATIVE=ON"), (avx2, "-DGGML_AMX_INT8=OFF -DX=ON")):
        (prefix / "bin").mkdir(parents=True)
        (prefix / "BUILD_INFO").write_text(f"isa x\ncmake_args {args}\n")
    native_bin, avx2_bin = native / "bin" / "llama-server", avx2 / "bin" / "llama-server"
    monkeypatch.delenv("LLAMA_ARG_REPACK", raising=False)
    monkeypatch.setattr(bench.server_proc, "cpu_flags", lambda: frozenset({"avx512f", "amx_int8"}))
    assert llamacpp_env(native_bin) == {"LLAMA_ARG_REPACK": "0"}
    assert llamacpp_env(tmp_path / "elsewhere" / "llama-server") == {"LLAMA_ARG_REPACK": "0"}
    assert llamacpp_env(avx2_bin) == {}
    monkeypatch.setenv("LLAMA_ARG_REPACK", "1")
    assert llamacpp_env(native_bin) == {}
    monkeypatch.delenv("LLAMA_ARG_REPACK")
    monkeypatch.setattr(bench.server_proc, "cpu_flags", lambda: frozenset({"avx512f"}))
    assert llamacpp_env(native_bin) == {}


def test_default_server_args_are_the_fast_cpu_configuration_and_overridable() -> None:
    args = build_parser().parse_args([])
    # no flags but the cache: the server's default is the fast setup for the CPU it runs on
    assert shlex.split(args.server_args) == ["--n-cells", "32768"]
    assert args.server_args == DEFAULT_SERVER_ARGS
    assert build_parser().parse_args(["--server-args", "--n-cells 1024"]).server_args == (
        "--n-cells 1024"
    )
    parsed = build_parser().parse_args(["--llamacpp", "/x/llama-server", "--no-llamacpp"])
    assert parsed.llamacpp == pathlib.Path("/x/llama-server") and parsed.no_llamacpp
    assert default_budget_s(quick=True, with_llamacpp=True) <= 600.0
    assert default_budget_s(quick=False, with_llamacpp=True) > default_budget_s(False, False)


def test_the_sweep_budget_gives_every_level_its_full_time_when_the_clock_allows() -> None:
    assert sweep_budget_s(QUICK, Clock(10_000.0), 0.4) == 2 * 60.0 * 1.5 + 30.0
    assert 39.0 < sweep_budget_s(QUICK, Clock(100.0), 0.4) <= 40.0
    longer = replace(QUICK, level_max_s=480.0)
    assert sweep_budget_s(longer, Clock(10_000.0), 0.4) == 2 * 480.0 * 1.5 + 30.0


def test_level_max_s_must_be_positive() -> None:
    assert build_parser().parse_args(["--level-max-s", "480"]).level_max_s == 480.0
    assert build_parser().parse_args([]).level_max_s is None
    with pytest.raises(SystemExit, match="--level-max-s"):
        main(["--level-max-s", "0", "--skip-micro", "--skip-serving", "--no-llamacpp"])


def write_script(path: pathlib.Path, body: str, mode: int) -> pathlib.Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("kind", ["missing", "not executable", "exits at once"])
def test_a_llamacpp_that_cannot_start_is_recorded_as_an_error(
    kind: str, tmp_path: pathlib.Path
) -> None:
    binary = {
        "missing": tmp_path / "no-such-llama-server",
        "not executable": write_script(tmp_path / "plain", "exit 0", 0o644),
        "exits at once": write_script(tmp_path / "dies", "echo 'no model'; exit 3", 0o755),
    }[kind]
    model = tmp_path / "model.gguf"
    result = run_llamacpp(tmp_path, QUICK, binary, 30.0, model_path=model, startup_s=10.0)
    assert result["binary"] == str(binary) and "sweep" not in result
    expected = "exited with status 3" if kind == "exits at once" else "not an executable file"
    assert result["error"].startswith("llama.cpp: ServerStartError") and expected in result["error"]
    if kind == "exits at once":
        log = (tmp_path / "llamacpp.log").read_text()
        assert f"-m {model} -t" in log and "no model" in log


def test_summary_puts_cellserve_and_llamacpp_side_by_side() -> None:
    ours = [make_level(50.0, 1), make_level(80.0, 8)]
    theirs = [make_level(20.0, 1), make_level(40.0, 8)]
    ours[0]["output_throughput"], theirs[0]["output_throughput"] = 15.0, 30.0
    ours[1]["output_throughput"], theirs[1]["output_throughput"] = 90.0, 60.0
    report = {
        "environment": {},
        "serving": {
            "command": ["python", "-m", "cli", "serve", "--quant", "int4"],
            "sweep": make_run(ours),
            "llamacpp": {
                "command": ["llama-server", "-m", "x.gguf", "-np", "32"],
                "sweep": {**make_run(theirs), "skipped_levels": [32]},
            },
        },
    }
    text = render_summary(report)
    assert "| 1 | 15.0 | 30.0 | 0.50x | 50.0 / 20.0 | 50.0 / 20.0 |" in text
    assert "| 8 | 90.0 | 60.0 | 1.50x | 80.0 / 40.0 | 80.0 / 40.0 |" in text
    assert "python -m cli serve --quant int4" in text
    assert "llama-server -m x.gguf -np 32" in text
    assert "llama.cpp skipped for time: concurrency [32]" in text
    report["serving"]["llamacpp"] = {"binary": "/x", "error": "llama.cpp: OSError: boom"}
    assert "**llama.cpp error:** llama.cpp: OSError: boom" in render_summary(report)


def test_summary_gives_resident_memory_after_start_and_at_its_peak() -> None:
    gib = 2**30
    report = {
        "environment": {},
        "serving": {
            "startup_s": 3.0, "rss_after_start": int(1.5 * gib), "rss_peak": int(2.25 * gib),
            "llamacpp": {"command": ["llama-server"], "startup_s": 2.0,  # its sweep failed:
                         "rss_after_start": 2 * gib, "error": "llama.cpp: boom"},  # no peak
        },
    }  # fmt: skip
    text = render_summary(report)
    assert "healthy in 3.0 s, RSS 1.50 GiB after start, 2.25 GiB at its peak over the load" in text
    assert "llama.cpp became healthy in 2.0 s, RSS 2.00 GiB after start.\n" in text


def test_a_served_process_reports_its_resident_memory_and_peak() -> None:
    import os

    from bench.server_proc import Served

    me = Served("http://x", 0.0, [], pid=os.getpid())
    rss, peak = me.rss_bytes(), me.peak_rss_bytes()
    assert rss is not None and peak is not None and 0 < rss <= peak
    assert Served("http://x", 0.0, [], pid=2**22 + 1).peak_rss_bytes() is None  # no such pid


def test_llamacpp_gets_the_cache_size_it_is_compared_at(tmp_path: pathlib.Path) -> None:
    binary = write_script(tmp_path / "dies", 'echo "args: $*"; exit 3', 0o755)
    result = run_llamacpp(tmp_path, QUICK, binary, 30.0, tmp_path / "m.gguf", 10.0, n_ctx=16384)
    assert "exited with status 3" in result["error"]
    assert "-c 16384 -np 32" in (tmp_path / "llamacpp.log").read_text()


@pytest.mark.parametrize("skip_prefix", [False, True])
def test_skip_prefix_leaves_out_the_shared_prefix_pair(
    skip_prefix: bool, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import contextlib
    from types import SimpleNamespace

    import bench.run as run

    @contextlib.contextmanager
    def fake_server(log, args, startup_s):
        yield SimpleNamespace(
            url="http://x", startup_s=1.0, command="cellserve", rss_bytes=int, peak_rss_bytes=int
        )

    pairs: list[list[str]] = []
    monkeypatch.setattr(run, "cellserve_process", fake_server)
    monkeypatch.setattr(run, "run_sweep", lambda url, sizes, clock: {"levels": []})
    monkeypatch.setattr(run, "run_prefix_pair", lambda out, s, args, c, t: pairs.append(args) or {})
    parsed = build_parser().parse_args(["--skip-prefix"] if skip_prefix else [])
    assert parsed.skip_prefix is skip_prefix
    report = run.run_serving(
        tmp_path, QUICK, ["--n-cells", "64"], Clock(60.0), 10.0, prefix=not parsed.skip_prefix
    )
    assert report["startup_s"] == 1.0 and report["sweep"] == {"levels": []}
    assert pairs == ([] if skip_prefix else [["--n-cells", "64"]])
