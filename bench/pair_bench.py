"""`python -m bench.pair_bench --model NAME`: one stream (c=1) against cellserve and llama.cpp's
llama-server in alternation, both up for the whole run, for the ITL and TTFT ratios.

`bench.run` measures one server and then the other, minutes apart; on a shared VM the memory's
bandwidth moves by tens of percent between such minutes (bench.bandwidth_bench read 28.5 and
47.9 GB/s on the same VM kind in two sessions), and a c=1 decode step is bound by it, so one such
run could not say whether cellserve's ITL is within 0.9x llama.cpp's (three runs of one build in
50 minutes gave 0.86x, 1.15x and 0.95x). Here each round sends the same few prompts (same seed)
to both servers, one right after the other, the first server alternating between rounds; the
ratio is taken within each round, and the report gives the rounds' median and range. A server
that is not being measured is idle (llama-server's threads and cellserve's engine thread wait).

Writes OUT/results.json and OUT/summary.md; prints the per-round table.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import statistics
import sys
import time
from contextlib import ExitStack
from typing import Any

from bench.cli import run_benchmark
from bench.models import PACKAGED, resolve_model
from bench.report import write_json
from bench.run import DEFAULT_SERVER_ARGS, default_llamacpp, environment, n_cells
from bench.server_proc import REPO_ROOT, Served, cellserve_process, llama_server
from bench.sweep import load_config
from bench.workloads import WorkloadSpec

SERVERS = ("cellserve", "llama.cpp")
STATS = ("itl_ms", "ttft_ms", "tpot_ms")


def one_round(
    url: str, seed: int, num_prompts: int, input_len: int, output_len: int, max_s: float
) -> dict[str, Any]:
    """`num_prompts` random prompts (`seed`'s) one after another at c=1 -> the level's dict."""
    spec = WorkloadSpec("random", num_prompts, input_len)
    cfg = load_config(url, output_len, max_s)
    result = run_benchmark(cfg, spec, [1], seed=seed, progress=False, warmup=False)
    return result["levels"][0]


def ratios(rounds: list[dict[str, Any]], stat: str) -> list[float]:
    """cellserve's p50 over llama.cpp's in each round where both completed a request."""
    out = []
    for r in rounds:
        ours, theirs = r["cellserve"], r["llama.cpp"]
        if ours["num_completed"] and theirs["num_completed"] and theirs[stat]["p50"] > 0:
            out.append(ours[stat]["p50"] / theirs[stat]["p50"])
    return out


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per statistic: the per-round ratios, their median, min and max; per server, the median
    of the rounds' p50s and output tok/s."""
    out: dict[str, Any] = {}
    for stat in STATS:
        rs = ratios(rounds, stat)
        out[stat] = {
            "ratios": rs,
            "median_ratio": statistics.median(rs) if rs else None,
            "min_ratio": min(rs) if rs else None,
            "max_ratio": max(rs) if rs else None,
        }
    for name in SERVERS:
        done = [r[name] for r in rounds if r[name]["num_completed"]]
        out[name] = {
            f"median_{stat}_p50": statistics.median(d[stat]["p50"] for d in done) if done else None
            for stat in STATS
        }
        out[name]["median_output_tok_s"] = (
            statistics.median(d["output_throughput"] for d in done) if done else None
        )
    return out


def table(rounds: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = [
        "| round | first | cellserve ITL / TTFT ms | llama.cpp ITL / TTFT ms | ITL ratio "
        "| TTFT ratio |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rounds):
        a, b = r["cellserve"], r["llama.cpp"]
        itl = a["itl_ms"]["p50"] / b["itl_ms"]["p50"] if b["itl_ms"]["p50"] else float("nan")
        ttft = a["ttft_ms"]["p50"] / b["ttft_ms"]["p50"] if b["ttft_ms"]["p50"] else float("nan")
        lines.append(
            f"| {i} | {r['first']} | {a['itl_ms']['p50']:.1f} / {a['ttft_ms']['p50']:.0f} | "
            f"{b['itl_ms']['p50']:.1f} / {b['ttft_ms']['p50']:.0f} | {itl:.3f}x | {ttft:.3f}x |"
        )
    itl, ttft = summary["itl_ms"], summary["ttft_ms"]
    if itl["median_ratio"] is not None and ttft["median_ratio"] is not None:
        lines.append(
            f"\nITL p50 ratio (cellserve / llama.cpp): median {itl['median_ratio']:.3f}x over "
            f"{len(itl['ratios'])} rounds (range {itl['min_ratio']:.3f}-{itl['max_ratio']:.3f}); "
            f"TTFT p50 ratio median {ttft['median_ratio']:.3f}x "
            f"(range {ttft['min_ratio']:.3f}-{ttft['max_ratio']:.3f})"
        )
    return "\n".join(lines)


def run_pairs(
    servers: dict[str, Served],
    rounds: int,
    num_prompts: int,
    input_len: int,
    output_len: int,
    max_s: float,
) -> list[dict[str, Any]]:
    """`rounds` rounds; in round i the same prompts (seed 1000 + i) go to both servers, cellserve
    first in even rounds. One short warm-up round first (not kept)."""
    for name in SERVERS:
        one_round(servers[name].url, 999, 1, input_len, 4, max_s)
    out = []
    for i in range(rounds):
        order = SERVERS if i % 2 == 0 else SERVERS[::-1]
        entry: dict[str, Any] = {"first": order[0]}
        for name in order:
            entry[name] = one_round(
                servers[name].url, 1000 + i, num_prompts, input_len, output_len, max_s
            )
        out.append(entry)
        print(
            f"round {i}: ITL p50 cellserve {entry['cellserve']['itl_ms']['p50']:.1f} ms, "
            f"llama.cpp {entry['llama.cpp']['itl_ms']['p50']:.1f} ms",
            flush=True,
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.pair_bench", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--model",
        default=None,
        help=f"a GGUF path or a packaged model's name ({', '.join(PACKAGED)}); default: the "
        "embedded SmolLM2-135M",
    )
    p.add_argument("--out", type=pathlib.Path, default=REPO_ROOT / "bench" / "results" / "pair")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prompts", type=int, default=3, help="requests per server and round")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--server-args",
        default=DEFAULT_SERVER_ARGS,
        help=f"`cellserve serve` flags, quoted (default: {DEFAULT_SERVER_ARGS!r}); llama.cpp's -c "
        "is their --n-cells",
    )
    p.add_argument("--llamacpp", type=pathlib.Path, default=None)
    p.add_argument(
        "--isa",
        choices=("generic", "avx2", "avx512", "avx512_bf16"),
        default=None,
        help="serve cellserve with CELLSERVE_ISA set to this level and compare with the llama.cpp "
        "built for it (LLAMA_ISA=... bench/build_llamacpp.sh)",
    )
    p.add_argument("--startup-timeout", type=float, default=300.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1 or args.prompts < 1:
        raise SystemExit("--rounds and --prompts: at least 1")
    if args.isa:  # inherited by the cellserve subprocess (model/kernels/isa.py)
        os.environ["CELLSERVE_ISA"] = args.isa
    binary = args.llamacpp or default_llamacpp(args.isa)
    if binary is None:
        raise SystemExit("no llama-server: bench/build_llamacpp.sh builds it, or pass --llamacpp")
    model_path = resolve_model(args.model)
    if model_path is None:
        from model import default_model_path

        model_path = default_model_path()
    server_args = [*shlex.split(args.server_args), "--model", str(model_path)]
    out_dir: pathlib.Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    # a round's requests may take this long (a 1.5B at c=1: ~6 s each on 2 cores)
    max_s = 60.0 + 30.0 * args.prompts
    report: dict[str, Any] = {
        "environment": environment(),
        "model": str(model_path),
        "rounds": args.rounds,
        "prompts_per_round": args.prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
    }
    start = time.perf_counter()
    with ExitStack() as stack:
        servers = {
            "cellserve": stack.enter_context(
                cellserve_process(out_dir / "server.log", server_args, args.startup_timeout)
            ),
            "llama.cpp": stack.enter_context(
                llama_server(
                    binary,
                    model_path,
                    out_dir / "llamacpp.log",
                    os.cpu_count() or 1,
                    args.startup_timeout,
                    n_cells(server_args),
                )
            ),
        }
        report["commands"] = {name: s.command for name, s in servers.items()}
        rounds = run_pairs(
            servers, args.rounds, args.prompts, args.input_len, args.output_len, max_s
        )
    report["seconds"] = time.perf_counter() - start
    report["per_round"] = rounds
    report["summary"] = summarize(rounds)
    write_json(out_dir / "results.json", report)
    text = table(rounds, report["summary"])
    (out_dir / "summary.md").write_text(text + "\n")
    print(text)
    return 0 if report["summary"]["itl_ms"]["ratios"] else 1


if __name__ == "__main__":
    sys.exit(main())
