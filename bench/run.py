"""`python -m bench.run --out DIR` (what `make bench` runs): every benchmark, bounded in time.

1. The micro-benchmarks that exist (bench.cache_bench, bench.model_bench, bench.isa_bench
   (every ISA path this CPU runs, and the cpuid flags seen), bench.engine_bench:
   `run(out_dir) -> dict`); a failure is recorded and the rest go on.
2. A cellserve started here on a free port: a random-prompt sweep over concurrency levels.
3. With a llama.cpp `llama-server` binary (--llamacpp, found by default where
   bench/build_llamacpp.sh puts it): the same sweep, same prompts, against it on the same GGUF.
   `--isa avx2` runs cellserve with CELLSERVE_ISA=avx2 and, by default, the llama-server that
   `LLAMA_ISA=avx2 bench/build_llamacpp.sh` builds: both on the same instruction set.
4. A shared-prefix workload against a fresh cellserve, then again against one started with
   --no-prefix-cache, for the TTFT ratio.
Everything goes under the out dir: results.json, summary.md, one folder per part.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, replace
from typing import Any

from bench import make_8b, make_moe
from bench.models import PACKAGED, decode_read_bytes, resolve_model
from bench.report import format_table, plot_levels, write_json
from bench.server_proc import REPO_ROOT, cellserve_process, llama_server, llamacpp_default
from bench.summary import write_summary
from bench.sweep import FULL, QUICK, Clock, Sizes, run_prefix, run_sweep, sweep_budget_s, ttft_ratio

MICRO_BENCHES = (
    "cache_bench",
    "model_bench",
    "isa_bench",
    "engine_bench",
    "constrained_bench",
    "recurrent_bench",
    "recurrent_spec_bench",
    "bandwidth_bench",
)
OPTIONAL_BENCHES = {"gemma_bench": "model.load.packaged:gemma3_installed"}  # run when installed


def micro_benches() -> list[str]:
    """MICRO_BENCHES, then each optional one whose model is installed."""
    names = list(MICRO_BENCHES)
    for name, check in OPTIONAL_BENCHES.items():
        module, func = check.split(":")
        if getattr(importlib.import_module(module), func)():
            names.append(name)
    return names


# no flags but the cache size: the default is the fast setup for this CPU (model.load.loader
# .choose_runtime); 32 x (256 + 128) tokens fit in the cache, so nothing is preempted
DEFAULT_SERVER_ARGS = "--n-cells 32768"


def run_micro(name: str, out_dir: pathlib.Path, package: str = "bench") -> dict[str, Any]:
    """Calls `{package}.{name}.run(out_dir / name)`; absent modules and failures are reported."""
    if importlib.util.find_spec(f"{package}.{name}") is None:
        return {"status": "absent"}
    start = time.perf_counter()
    try:
        module = importlib.import_module(f"{package}.{name}")
        (out_dir / name).mkdir(parents=True, exist_ok=True)
        result = module.run(out_dir / name)
    except Exception as exc:  # noqa: BLE001  (one benchmark's failure must not stop the rest)
        (out_dir / f"{name}.error.txt").write_text(traceback.format_exc())
        return {
            "status": "failed",
            "seconds": time.perf_counter() - start,
            "error": f"{type(exc).__name__}: {exc}"[:300],
        }
    return {"status": "ok", "seconds": time.perf_counter() - start, "result": result}


def _save_sweep(out_dir: pathlib.Path, sweep: dict[str, Any], title: str) -> None:
    write_json(out_dir / "results.json", sweep)
    if sweep["levels"]:
        plot_levels(out_dir / "results.png", sweep["levels"], title)
        print(format_table(sweep["levels"]), flush=True)


def run_llamacpp(
    out_dir: pathlib.Path,
    sizes: Sizes,
    binary: pathlib.Path,
    budget_s: float,
    model_path: pathlib.Path | None = None,
    startup_s: float = 120.0,
    n_ctx: int = 32768,
) -> dict[str, Any]:
    """`run_sweep` against llama-server on the same GGUF with `n_ctx` cells; a failure is returned
    as "error"."""
    report: dict[str, Any] = {"binary": str(binary)}
    log = out_dir / "llamacpp.log"
    try:
        from model import default_model_path

        model = model_path or default_model_path()
        n_threads = os.cpu_count() or 1
        with llama_server(binary, model, log, n_threads, startup_s, n_ctx) as srv:
            report["command"] = srv.command
            report["startup_s"] = srv.startup_s
            report["rss_after_start"] = srv.rss_bytes()
            report["sweep"] = run_sweep(srv.url, sizes, Clock(budget_s))
            report["rss_peak"] = srv.peak_rss_bytes()
    except Exception as exc:  # noqa: BLE001  (the comparison is optional; cellserve's run goes on)
        report["error"] = f"llama.cpp: {type(exc).__name__}: {exc}; see {log}"
        return report
    title = f"random in={sizes.input_len} out={sizes.output_len} (llama.cpp, CPU)"
    _save_sweep(out_dir / "llamacpp", report["sweep"], title)
    return report


def run_serving(
    out_dir: pathlib.Path,
    sizes: Sizes,
    server_args: list[str],
    clock: Clock,
    startup_s: float,
    llamacpp: pathlib.Path | None = None,
    model_path: pathlib.Path | None = None,
    prefix: bool = True,
) -> dict[str, Any]:
    """The sweep on cellserve, then on llama.cpp, then (`prefix`) the shared-prefix pair."""
    report: dict[str, Any] = {"decode_read_bytes": decode_read_bytes(model_path)}
    budget_s = sweep_budget_s(sizes, clock, 0.4 if llamacpp else 0.6)
    report["sweep_budget_s"] = budget_s
    try:
        with cellserve_process(out_dir / "server.log", server_args, startup_s) as srv:
            report["startup_s"] = srv.startup_s
            report["rss_after_start"] = srv.rss_bytes()
            report["command"] = srv.command
            report["sweep"] = run_sweep(srv.url, sizes, Clock(budget_s))
            report["rss_peak"] = srv.peak_rss_bytes()
    except Exception as exc:  # noqa: BLE001  (report it; the server is stopped already)
        report["error"] = f"cellserve: {type(exc).__name__}: {exc}; see {out_dir / 'server.log'}"
        return report
    title = f"random in={sizes.input_len} out={sizes.output_len} (cellserve, CPU)"
    _save_sweep(out_dir / "sweep", report["sweep"], title)
    if llamacpp is not None:
        print(f"== serving (llama.cpp: {llamacpp})", flush=True)
        report["llamacpp"] = run_llamacpp(
            out_dir, sizes, llamacpp, budget_s, model_path, n_ctx=n_cells(server_args)
        )
    if not prefix:
        return report
    return {**report, **run_prefix_pair(out_dir, sizes, server_args, clock, startup_s)}


def n_cells(server_args: list[str]) -> int:
    """The cache size in `server_args` (--n-cells N or --n-cells=N), which llama.cpp's -c mirrors;
    the DEFAULT_SERVER_ARGS' 32768 when absent."""
    value = "32768"
    for idx, arg in enumerate(server_args):
        if arg == "--n-cells" and idx + 1 < len(server_args):
            value = server_args[idx + 1]
        elif arg.startswith("--n-cells="):
            value = arg.split("=", 1)[1]
    return int(value)


def run_prefix_pair(
    out_dir: pathlib.Path, sizes: Sizes, server_args: list[str], clock: Clock, startup_s: float
) -> dict[str, Any]:
    """The shared-prefix workload with the prefix cache and without, each on a fresh server."""
    report: dict[str, Any] = {}
    log = out_dir / "server-prefix-cache.log"
    try:
        with cellserve_process(log, server_args, startup_s) as srv:
            # the rest: this run, the second server's start-up, and its run
            report["prefix_on"] = run_prefix(srv.url, sizes, (clock.left() - srv.startup_s) / 2)
    except Exception as exc:  # noqa: BLE001
        report["error"] = f"cellserve: {type(exc).__name__}: {exc}; see {log}"
        return report
    off_args = [*server_args, "--no-prefix-cache"]
    log = out_dir / "server-no-prefix-cache.log"
    try:
        with cellserve_process(log, off_args, startup_s) as srv:
            report["prefix_off"] = run_prefix(srv.url, sizes, clock.left())
    except Exception as exc:  # noqa: BLE001
        report["error"] = f"cellserve --no-prefix-cache: {type(exc).__name__}: {exc}; see {log}"
        return report
    report["prefix_ttft_ratio"] = ttft_ratio(report["prefix_on"], report["prefix_off"])
    write_json(out_dir / "prefix" / "results.json", report)
    return report


def environment() -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    ).stdout.strip()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": commit or None,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cellserve_isa": os.environ.get("CELLSERVE_ISA") or None,
    }


def default_llamacpp(isa: str | None = None) -> pathlib.Path | None:
    path = llamacpp_default(isa)
    return path if path.is_file() else None


def default_budget_s(quick: bool, with_llamacpp: bool) -> float:
    """Room for the micro-benchmarks, the sweep(s) at their full per-level time, the prefix runs."""
    if with_llamacpp:
        return 600.0 if quick else 2200.0
    return 480.0 if quick else 1200.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=pathlib.Path, default=REPO_ROOT / "bench" / "results")
    p.add_argument("--quick", action="store_true", help="smaller sizes (a few minutes)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="default 1200, quick 480; with llama.cpp 2200, quick 600",
    )
    p.add_argument("--skip-micro", action="store_true")
    p.add_argument(
        "--micro",
        default=None,
        help="only these micro-benchmarks, comma-separated (e.g. bandwidth_bench)",
    )
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument(
        "--skip-prefix",
        action="store_true",
        help="no shared-prefix pair after the sweep (on an 8B its 1000-token prompts without "
        "the prefix cache outlast any budget)",
    )
    p.add_argument(
        "--server-args",
        default=DEFAULT_SERVER_ARGS,
        help=f"`cellserve serve` flags, quoted (default: {DEFAULT_SERVER_ARGS!r})",
    )
    p.add_argument(
        "--llamacpp",
        type=pathlib.Path,
        default=None,
        help="llama-server binary to compare with (default: the one bench/build_llamacpp.sh "
        "builds for --isa, or natively, when it exists)",
    )
    p.add_argument(
        "--isa",
        choices=("generic", "avx2", "avx512", "avx512_bf16"),
        default=None,
        help="serve cellserve with CELLSERVE_ISA set to this level (compare with the llama.cpp "
        "built for it); for the micro-benchmarks set CELLSERVE_ISA in the environment",
    )
    p.add_argument(
        "--concurrency",
        default=None,
        help="the sweep's concurrency levels, comma-separated (default 1,8,32; quick 1,4)",
    )
    p.add_argument(
        "--level-max-s",
        type=float,
        default=None,
        help="seconds a concurrency level may start requests (running ones are cut at 1.5x; "
        "default 150, quick 60): raise it where c=32 on a larger model takes longer, or a "
        "level's requests are all cut off",
    )
    p.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp comparison")
    p.add_argument(
        "--model",
        default=None,
        help="the GGUF both servers serve: a path, or a packaged model's name "
        f"({', '.join(PACKAGED)}; model/load/packaged.py), or {make_8b.NAME} (made by "
        f"`python -m bench.make_8b`) or {make_moe.NAME} (made by `python -m bench.make_moe`); "
        "default: the embedded SmolLM2-135M",
    )
    p.add_argument("--startup-timeout", type=float, default=300.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.concurrency:
        levels = tuple(int(c) for c in args.concurrency.split(",") if c.strip())
        if not levels or min(levels) < 1:
            raise SystemExit(f"--concurrency {args.concurrency!r}: positive integers, e.g. 1,32")
        sizes = replace(sizes, concurrencies=levels)
    if args.level_max_s is not None:
        if args.level_max_s <= 0:
            raise SystemExit(f"--level-max-s {args.level_max_s}: a positive number of seconds")
        sizes = replace(sizes, level_max_s=args.level_max_s)
    if args.isa:  # inherited by the cellserve subprocesses (model/kernels/isa.py)
        os.environ["CELLSERVE_ISA"] = args.isa
    llamacpp = args.llamacpp or default_llamacpp(args.isa)
    if args.no_llamacpp:
        llamacpp = None
    model_path = resolve_model(args.model)
    server_args = shlex.split(args.server_args)
    if model_path is not None:
        server_args += ["--model", str(model_path)]
    clock = Clock(args.budget_s or default_budget_s(args.quick, llamacpp is not None))
    out_dir: pathlib.Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"environment": environment(), "sizes": asdict(sizes)}
    report["micro"] = {}
    if not args.skip_micro:
        names = micro_benches() if not args.micro else args.micro.split(",")
        for name in names:
            print(f"== {name}", flush=True)
            report["micro"][name] = run_micro(name, out_dir)
            print(f"   {report['micro'][name]['status']}", flush=True)
            write_json(out_dir / "results.json", report)
    if not args.skip_serving:
        print("== serving (cellserve subprocess)", flush=True)
        report["serving"] = run_serving(
            out_dir,
            sizes,
            server_args,
            clock,
            args.startup_timeout,
            llamacpp,
            model_path,
            prefix=not args.skip_prefix,
        )
    write_json(out_dir / "results.json", report)
    summary = write_summary(out_dir / "summary.md", report)
    print(summary)
    failed = [n for n, m in report["micro"].items() if m["status"] == "failed"]
    serving = report.get("serving", {})
    completed = sum(lv["num_completed"] for lv in serving.get("sweep", {}).get("levels", []))
    serving_ok = args.skip_serving or ("error" not in serving and completed > 0)
    return 0 if serving_ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
