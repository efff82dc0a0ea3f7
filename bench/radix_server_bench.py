"""`python -m bench.radix_server_bench [--conversations 1000] [--n-cells 360000] [--out DIR]`: the
prefix index over held cells (scheduler/radix.py) measured on a real server (`cellserve serve`,
the embedded SmolLM2-135M unless `--server-args` names another model).

For each setting (`--prefix-index` on, then off: the holders-only cache of `--n-seq-max`), a
fresh server gets `--conversations` distinct conversations: a prompt of `--prompt-len` random
token ids answered greedily with `--answer-len` tokens (round 1, every conversation seen once),
then each continued once (round 2: its prompt + the answer's token ids + `--turn-len` new ids).
Reported per setting: the continuations whose `usage.prompt_tokens_details.cached_tokens` is
>= 90% of their history (prompt + answer), the mean hit ratio, and the wall time of each round.

Prompts go to /v1/completions as token ids, and the answer's ids come back through
`return_tokens_as_token_ids`, so the history is exactly the tokens the server computed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from bench.server_proc import cellserve

LOW_ID, HIGH_ID = 1_000, 40_000  # plain vocabulary ids of SmolLM2 (49,152), no special tokens


def complete(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    r = client.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def answer_ids(resp: dict[str, Any]) -> list[int]:
    tokens = resp["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def cached_tokens(resp: dict[str, Any]) -> int:
    details = resp["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def run_setting(args: argparse.Namespace, index: bool, out: pathlib.Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(LOW_ID, HIGH_ID) for _ in range(args.prompt_len)]
        for _ in range(args.conversations)
    ]
    turns = [
        [rng.randrange(LOW_ID, HIGH_ID) for _ in range(args.turn_len)]
        for _ in range(args.conversations)
    ]
    server_args = [
        "--n-cells",
        str(args.n_cells),
        "--n-seq-max",
        str(args.n_seq_max),
        "--ctx-per-seq",
        str(args.prompt_len + args.answer_len + args.turn_len + args.answer_len + 16),
        "--prefix-index" if index else "--no-prefix-index",
        *args.server_args.split(),
    ]
    log = out / f"server_{'index' if index else 'no_index'}.log"
    with cellserve(log, server_args) as (url, startup_s), httpx.Client() as client:
        with ThreadPoolExecutor(args.concurrency) as pool:
            t0 = time.perf_counter()
            first = list(pool.map(lambda p: complete(client, url, p, args.answer_len), prompts))
            t1 = time.perf_counter()
            histories = [p + answer_ids(r) for p, r in zip(prompts, first, strict=True)]
            second = list(
                pool.map(
                    lambda ht: complete(client, url, ht[0] + ht[1], args.answer_len),
                    zip(histories, turns, strict=True),
                )
            )
            t2 = time.perf_counter()
        metrics = client.get(f"{url}/metrics").text
    ratios = [cached_tokens(r) / len(h) for r, h in zip(second, histories, strict=True)]
    index_lines = [ln for ln in metrics.splitlines() if ln.startswith("cellserve_prefix_index")]
    return {
        "prefix_index": index,
        "startup_s": round(startup_s, 1),
        "continuations": len(ratios),
        "hit_ge_90pct": sum(r >= 0.9 for r in ratios),
        "mean_hit_ratio": round(sum(ratios) / len(ratios), 4),
        "round1_s": round(t1 - t0, 1),
        "round2_s": round(t2 - t1, 1),
        "round1_cached_tokens": sum(cached_tokens(r) for r in first),
        "metrics_at_end": index_lines,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=1000)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--answer-len", type=int, default=8)
    p.add_argument("--turn-len", type=int, default=20)
    p.add_argument("--n-cells", type=int, default=360_000)
    p.add_argument("--n-seq-max", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--settings", default="on,off", help="prefix index settings to run, in order")
    p.add_argument("--server-args", default="", help="more `cellserve serve` flags")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/out/radix_server"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for setting in args.settings.split(","):
        res = run_setting(args, setting == "on", args.out)
        print(json.dumps(res), flush=True)
        results.append(res)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}
    (args.out / "radix_server.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
