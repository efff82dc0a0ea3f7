"""`python -m bench.tier_bench [--model NAME|PATH] [--out DIR]`: what the prefix cache's second
tier (--cache-ram, --cache-dir) buys, on real servers.

1. Restart: a server with --cache-dir answers a long prompt (greedy), stops; a fresh server on
   the same directory answers it again. Reported: both TTFTs, the second's cached tokens, whether
   the texts match, the size of the directory's files.
2. Hit rate: `--systems` system prompts of `--system-len` tokens, `--questions` questions each,
   asked round-robin over the systems (system 1 q1, system 2 q1, ... then every q2 ...), so a
   live cache of `--small-cells` cells holds only the last few systems when one comes back.
   Three servers in turn: that small cache, the same with --cache-ram, and a cache where all
   fits. Reported: cached prompt tokens / prompt tokens over all requests.

Prompts are random words, sized with the server's POST /tokenize.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import tempfile
import time
from typing import Any

import httpx

from bench.loadgen import stream_chunks
from bench.models import resolve_model
from bench.server_proc import cellserve

WORDS = (
    "river",
    "stone",
    "garden",
    "lamp",
    "window",
    "paper",
    "orange",
    "signal",
    "market",
    "cloud",
    "engine",
    "forest",
    "bridge",
    "silver",
    "letter",
    "candle",
    "harbor",
    "music",
    "winter",
    "valley",
    "rocket",
    "pencil",
    "mirror",
    "ladder",
)


def words_for(url: str, n_tokens: int, rng: random.Random) -> str:
    """Random words that tokenize to about n_tokens tokens."""
    text = " ".join(rng.choice(WORDS) for _ in range(n_tokens))
    while True:
        n = len(httpx.post(f"{url}/tokenize", json={"content": text}).json()["tokens"])
        if n <= n_tokens:
            return text
        text = " ".join(text.split()[: max(1, len(text.split()) * n_tokens // n - 1)])


def complete(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """Streamed greedy completion -> {ttft_s, text, prompt_tokens, cached_tokens}."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    for chunk in stream_chunks(f"{url}/v1/completions", body):
        if chunk.get("choices"):
            ttft = ttft or time.perf_counter() - t0
            text += chunk["choices"][0].get("text", "")
        usage = chunk.get("usage") or usage
    assert usage is not None and ttft is not None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "ttft_s": ttft,
        "text": text,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": cached,
    }


def restart(model: list[str], out: pathlib.Path, prompt_len: int, n_cells: int) -> dict:
    with tempfile.TemporaryDirectory() as cache_dir:
        args = [*model, "--n-cells", str(n_cells), "--cache-dir", cache_dir]
        with cellserve(out / "restart_cold.log", args) as (url, _):
            prompt = words_for(url, prompt_len, random.Random(1))
            cold = complete(url, prompt, 16)
        with cellserve(out / "restart_warm.log", args) as (url, startup_s):
            warm = complete(url, prompt, 16)
        files = list(pathlib.Path(cache_dir).rglob("*"))
        size = sum(f.stat().st_size for f in files if f.is_file())
    return {
        "prompt_tokens": cold["prompt_tokens"],
        "cold_ttft_ms": round(cold["ttft_s"] * 1e3, 1),
        "warm_ttft_ms": round(warm["ttft_s"] * 1e3, 1),
        "warm_over_cold": round(warm["ttft_s"] / cold["ttft_s"], 3),
        "warm_cached_tokens": warm["cached_tokens"],
        "same_text": cold["text"] == warm["text"],
        "cache_dir_bytes": size,
        "warm_startup_s": round(startup_s, 2),
    }


def hit_rate(args: argparse.Namespace, model: list[str], out: pathlib.Path) -> dict:
    runs = {
        "small": ["--n-cells", str(args.small_cells)],
        "small + --cache-ram": ["--n-cells", str(args.small_cells), "--cache-ram", "1024"],
        "all fits": ["--n-cells", str(args.systems * (args.system_len + 64) + 512)],
    }
    result = {}
    for name, extra in runs.items():
        log = out / f"hits_{name.split()[0]}{'_ram' if 'ram' in name else ''}.log"
        with cellserve(log, [*model, *extra]) as (url, _):
            rng = random.Random(2)
            systems = [words_for(url, args.system_len, rng) for _ in range(args.systems)]
            prompt_tokens = cached = 0
            for q in range(args.questions):
                for s, system in enumerate(systems):
                    r = complete(url, f"{system}\nQuestion {q} about part {s}:", 4)
                    prompt_tokens += r["prompt_tokens"]
                    cached += r["cached_tokens"]
        result[name] = round(cached / prompt_tokens, 3)
        print(f"  {name}: hit rate {result[name]}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a packaged name or a path")
    ap.add_argument("--out", default="bench/results/tier", type=pathlib.Path)
    ap.add_argument("--prompt-len", type=int, default=1500)
    ap.add_argument("--systems", type=int, default=12)
    ap.add_argument("--system-len", type=int, default=400)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--small-cells", type=int, default=1200)
    args = ap.parse_args()
    path = resolve_model(args.model)
    model = ["--model", str(path)] if path is not None else []
    args.out.mkdir(parents=True, exist_ok=True)
    print("restart with --cache-dir ...", flush=True)
    result = {"restart": restart(model, args.out, args.prompt_len, 4096)}
    print(f"  {result['restart']}", flush=True)
    print("hit rate ...", flush=True)
    result["hit_rate"] = hit_rate(args, model, args.out)
    (args.out / "tier.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
