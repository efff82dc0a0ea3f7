"""`python -m bench.spec_bench`: speculative decoding side by side in one run.

The code-edit workload (bench/workloads.py: rename a variable in a ~200-token Python function,
return the whole function; chat, greedy, until the model stops or --output-len) at c=1, one
request after another, against, each on a fresh server with the same --n-cells:
cellserve without speculation, with n-gram lookup (--spec-type ngram), with the draft model
(--model-draft), with both (--spec-type ngram --model-draft: the lookup first, the draft
model where it finds nothing), and llama.cpp's llama-server without and with the same draft
(-md, --spec-draft-n-max 16) and with both (--spec-type ngram-simple,draft-simple), and
cellserve's draft with a reduced head ("cellserve draft-vocab": --draft-vocab). --servers
picks some of them by name. Per server: output tokens/s (completion tokens / request time, summed),
TTFT p50, and for cellserve's modes whether every reply is the same text as without
speculation. Then the random workload at the --load concurrencies (ignore_eos, 128 tokens),
cellserve without and with each speculation: throughput must not drop. --skip-code-edit runs
only the latter.

Models: the packaged Qwen2.5-Coder-1.5B-Instruct Q4_K_M (target) and 0.5B (draft)
(`python -m model.load.packaged NAME`), or --target / --draft paths.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import time
from contextlib import AbstractContextManager
from typing import Any

import httpx

from bench.loadgen import LoadConfig, run_sweep, stream_chunks
from bench.models import resolve_model
from bench.report import write_json
from bench.server_proc import Served, cellserve_process, llamacpp_default, served
from bench.workloads import PromptBuilder, WorkloadSpec, code_edit_turn

N_CTX = 8192
LOAD_OUTPUT_LEN = 64


def ask(url: str, prompt: str, output_len: int) -> dict[str, Any]:
    """One streamed chat request: its text, completion tokens, TTFT and time."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, usage, ttft = [], {}, None
    start = time.perf_counter()
    for chunk in stream_chunks(f"{url}/v1/chat/completions", body):
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece and ttft is None:
                ttft = time.perf_counter() - start
            text.append(piece)
    return {
        "text": "".join(text),
        "tokens": int(usage.get("completion_tokens", 0)),
        "ttft": ttft,
        "seconds": time.perf_counter() - start,
    }


def code_edit(url: str, prompts: list[str], output_len: int) -> dict[str, Any]:
    ask(url, prompts[0], 8)  # warm up
    replies = [ask(url, p, output_len) for p in prompts]
    tokens = sum(r["tokens"] for r in replies)
    seconds = sum(r["seconds"] for r in replies)
    return {
        "tok_s": round(tokens / seconds, 2),
        "tokens": tokens,
        "ttft_p50_ms": round(1e3 * statistics.median(r["ttft"] or 0 for r in replies), 1),
        "texts": [r["text"] for r in replies],
    }


def spec_counters(url: str) -> dict[str, float]:
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    text = httpx.get(f"{url}/metrics").text
    out = {}
    for line in text.splitlines():
        for n in names:
            if line.startswith(f"vllm:spec_decode_{n}_total "):
                out[n] = float(line.split()[-1])
            if line.startswith(f"cellserve_spec_decode_source_{n}_total{{"):
                source = line.split('source="')[1].split('"')[0]
                out[f"{source}_{n}"] = float(line.split()[-1])
    return out


def load_levels(url: str, levels: list[int], num_prompts: int) -> dict[str, float]:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    cfg = LoadConfig(base_url=url, model=model, output_len=LOAD_OUTPUT_LEN)
    spec = WorkloadSpec("random", num_prompts, 256)
    got = run_sweep(cfg, spec, lambda rng: PromptBuilder(rng), levels, progress=False)  # type: ignore[arg-type]
    return {f"c{lv.concurrency}": round(lv.metrics.output_throughput, 2) for lv in got}


def run(args: argparse.Namespace) -> dict[str, Any]:
    target, draft = resolve_model(args.target), resolve_model(args.draft)
    assert target is not None and draft is not None
    rng = random.Random(args.seed)
    prompts = [code_edit_turn(rng, args.input_len)[0] for _ in range(args.num_prompts)]
    out_dir: pathlib.Path = args.out
    threads = str(os.cpu_count() or 1)
    base = ["--model", str(target), "--n-cells", str(N_CTX)]
    servers: dict[str, list[str]] = {
        "cellserve": base,
        "cellserve ngram": [*base, "--spec-type", "ngram", "--draft-max", str(args.draft_max)],
        "cellserve draft": [*base, "--model-draft", str(draft), "--draft-max", str(args.draft_max)],
        "cellserve draft-vocab": [
            *base,
            *("--model-draft", str(draft), "--draft-max", str(args.draft_max)),
            *("--draft-vocab", str(args.draft_vocab)),
        ],
        "cellserve ngram+draft-vocab": [
            *base,
            *("--spec-type", "ngram", "--model-draft", str(draft)),
            *("--draft-max", str(args.draft_max), "--draft-vocab", str(args.draft_vocab)),
        ],
        "cellserve ngram+draft": [
            *base,
            *("--spec-type", "ngram", "--model-draft", str(draft)),
            *("--draft-max", str(args.draft_max)),
        ],
    }
    llama = args.llamacpp or llamacpp_default()
    lcpp = [str(llama), "-m", str(target), "-t", threads, "-c", str(N_CTX), "-np", "1"]
    lcpp_servers = {
        "llama.cpp": lcpp,
        "llama.cpp draft": [*lcpp, "-md", str(draft), "--spec-draft-n-max", str(args.draft_max)],
        "llama.cpp ngram+draft": [
            *(*lcpp, "-md", str(draft), "--spec-draft-n-max", str(args.draft_max)),
            *("--spec-type", "ngram-simple,draft-simple"),
        ],
    }
    report: dict[str, Any] = {"prompts": len(prompts), "output_len": args.output_len}
    runs: dict[str, Any] = {}

    def start(name: str) -> AbstractContextManager[Served]:
        log = out_dir / f"{name.replace(' ', '-').replace('.', '')}.log"
        if name in servers:
            return cellserve_process(log, servers[name], args.startup_timeout)
        cmd = lcpp_servers[name]
        return served(lambda port: [*cmd, "--host", "127.0.0.1", "--port", str(port)], log, 300)

    names = list(servers) + (list(lcpp_servers) if llama.is_file() else [])
    if args.servers:
        wanted = [n.strip() for n in args.servers.split(",")]
        unknown = sorted(set(wanted) - set(servers) - set(lcpp_servers))
        if unknown or "cellserve" not in wanted:
            raise SystemExit(f"--servers: unknown {unknown} (and 'cellserve' is the baseline)")
        names = [n for n in names if n in wanted]
    for name in names:
        if args.skip_code_edit and name not in servers:
            continue
        print(f"== {name}", flush=True)
        with start(name) as srv:
            runs[name] = {} if args.skip_code_edit else code_edit(srv.url, prompts, args.output_len)
            if name in servers and name != "cellserve":
                runs[name]["spec"] = spec_counters(srv.url)
            if name in servers and args.load:
                levels = [int(c) for c in args.load.split(",")]
                print(f"   {name}: random load {levels}", flush=True)
                runs[name]["load_tok_s"] = load_levels(srv.url, levels, args.load_prompts)
                if name != "cellserve":  # the counters after the load too
                    runs[name]["spec_after_load"] = spec_counters(srv.url)
        r = runs[name]
        print(f"   {r.get('tok_s')} tok/s, TTFT p50 {r.get('ttft_p50_ms')} ms", flush=True)
    report["runs"] = runs
    if args.skip_code_edit:
        return report
    plain = runs["cellserve"]
    for name, r in runs.items():
        r["x_cellserve"] = round(r["tok_s"] / plain["tok_s"], 2)
        if name.startswith("cellserve"):
            r["same_text"] = r["texts"] == plain["texts"]
    for anchor in ("llama.cpp draft", "llama.cpp ngram+draft"):
        key = "x_" + anchor.replace(".", "").replace(" ", "_").replace("+", "_")
        for name in (n for n in runs if n.startswith("cellserve ") and anchor in runs):
            runs[name][key] = round(runs[name]["tok_s"] / runs[anchor]["tok_s"], 2)
    report["runs"] = runs
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spec_bench", description=__doc__)
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="packaged name or path")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="packaged name or path")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--input-len", type=int, default=200, help="tokens of each function")
    p.add_argument("--output-len", type=int, default=400)
    p.add_argument("--draft-max", type=int, default=16)
    p.add_argument(
        "--draft-vocab", type=int, default=32768, help="the 'cellserve draft-vocab' server's"
    )
    p.add_argument("--load", default="8", help="random-workload concurrencies ('' = none)")
    p.add_argument("--load-prompts", type=int, default=32)
    p.add_argument("--llamacpp", type=pathlib.Path, default=None)
    p.add_argument("--skip-code-edit", action="store_true", help="only the --load levels")
    p.add_argument("--servers", default="", help="comma-separated names to run (default: all)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results/spec"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = run(args)
    write_json(args.out / "results.json", report)
    for name, r in report["runs"].items():
        extra = {k: v for k, v in r.items() if k not in ("texts",)}
        print(f"{name:18s} {json.dumps(extra)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
