"""`cellserve bench`: a serving benchmark against any OpenAI-compatible server.

cellserve bench --base-url http://127.0.0.1:8000 --concurrency 1,8,32 --out bench/results/x
cellserve bench --workload shared-prefix --prefix-len 1000 --input-len 32 --request-rate 2
"""

from __future__ import annotations

import argparse
import math
import pathlib
import random
import sys
from typing import Any

import httpx

from bench.loadgen import LoadConfig, root_url, run_sweep
from bench.metrics import parse_slo
from bench.report import format_table, plot_levels, write_json
from bench.workloads import WORKLOADS, CountFn, PromptBuilder, WorkloadSpec, server_token_counter


def parse_concurrency(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"concurrency must be positive integers: {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cellserve bench",
        description="Streams requests to an OpenAI-compatible server and reports TTFT, TPOT, "
        "ITL, end-to-end latency, throughput and goodput, measured on the client.",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default=None,
        help="default: chat for multi-turn and code-edit, completions otherwise",
    )
    p.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", choices=WORKLOADS, default="random")
    p.add_argument("--num-prompts", type=int, default=32, help="sessions per load level")
    p.add_argument("--input-len", type=int, default=256, help="tokens per user turn")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--prefix-len", type=int, default=1000, help="shared-prefix system prompt")
    p.add_argument("--turns", type=int, default=3, help="multi-turn: turns per chat")
    p.add_argument(
        "--concurrency",
        type=parse_concurrency,
        default=None,
        help="sessions in flight, comma list to sweep (default 8; with --request-rate: no cap)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default: all at once)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--slo",
        type=parse_slo,
        default=None,
        help="goodput SLOs in seconds, e.g. ttft=0.5,tpot=0.05",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument(
        "--max-duration",
        type=float,
        default=None,
        help="seconds per level after which no new session starts",
    )
    p.add_argument(
        "--no-tokenize",
        action="store_true",
        help="do not calibrate prompt lengths with POST /tokenize",
    )
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--out", type=pathlib.Path, default=None, help="write results.json and results.png here"
    )
    return p


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def resolve_model(client: httpx.Client) -> str:
    """The first model the server lists, or 'default' when it lists none."""
    try:
        resp = client.get("/v1/models")
        resp.raise_for_status()
        data = resp.json().get("data") or []
        return str(data[0]["id"]) if data else "default"
    except (httpx.HTTPError, KeyError, ValueError, AttributeError):
        return "default"


def run_benchmark(
    cfg: LoadConfig,
    spec: WorkloadSpec,
    concurrencies: list[int | None],
    request_rate: float = math.inf,
    seed: int = 0,
    slo: dict[str, float] | None = None,
    tokenize: bool = True,
    progress: bool = True,
    warmup: bool = True,
) -> dict[str, Any]:
    """Runs the sweep; returns the JSON-ready results (config + one entry per level)."""
    with httpx.Client(
        base_url=root_url(cfg.base_url),
        headers=_headers(cfg.api_key),
        timeout=30.0,
        trust_env=False,
    ) as client:
        if not cfg.model:
            cfg.model = resolve_model(client)
        count: CountFn | None = server_token_counter(client, cfg.model) if tokenize else None

        def builder_for(rng: random.Random) -> PromptBuilder:
            return PromptBuilder(rng, count)

        levels = run_sweep(
            cfg, spec, builder_for, concurrencies, request_rate, seed, slo, progress, warmup
        )
    return {
        "base_url": cfg.base_url,
        "model": cfg.model,
        "endpoint": cfg.endpoint,
        "workload": {
            "name": spec.name,
            "num_prompts": spec.num_prompts,
            "input_len": spec.input_len,
            "output_len": cfg.output_len,
            "prefix_len": spec.prefix_len if spec.name == "shared-prefix" else None,
            "turns": spec.turns if spec.name == "multi-turn" else None,
        },
        "prompt_lengths": "calibrated with /tokenize" if count else "approximate",
        "ignore_eos": cfg.ignore_eos,
        "temperature": cfg.temperature,
        "seed": seed,
        "slo_s": slo,
        "levels": [level.to_dict() for level in levels],
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    chat_default = args.workload in ("multi-turn", "code-edit")
    endpoint = args.endpoint or ("chat" if chat_default else "completions")
    concurrencies: list[int | None] = list(args.concurrency or [])
    if not concurrencies:
        concurrencies = [None] if math.isfinite(args.request_rate) else [8]
    cfg = LoadConfig(
        base_url=args.base_url,
        model=args.model or "",
        endpoint=endpoint,
        output_len=args.output_len,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        api_key=args.api_key,
        timeout_s=args.timeout,
        max_duration_s=args.max_duration,
    )
    spec = WorkloadSpec(
        args.workload, args.num_prompts, args.input_len, args.prefix_len, args.turns
    )
    results = run_benchmark(
        cfg,
        spec,
        concurrencies,
        args.request_rate,
        args.seed,
        args.slo,
        tokenize=not args.no_tokenize,
        progress=not args.no_progress,
        warmup=not args.no_warmup,
    )
    title = f"{args.workload} in={args.input_len} out={args.output_len} @ {args.base_url}"
    print(f"{title} (model {cfg.model}; prompt lengths {results['prompt_lengths']})")
    print(format_table(results["levels"]))
    for level in results["levels"]:
        for error in level["errors"]:
            print(f"error sample: {error}", file=sys.stderr)
    if args.out is not None:
        write_json(args.out / "results.json", results)
        plot_levels(args.out / "results.png", results["levels"], title)
        print(f"wrote {args.out / 'results.json'} and {args.out / 'results.png'}")
    return 0 if any(level["num_completed"] for level in results["levels"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
