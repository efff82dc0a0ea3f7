"""`python -m bench.fidelity [--model NAME|PATH]`: how close cellserve's default path is to
llama.cpp on the same GGUF, and both to the float32 reference.

Three servers on the same file, each fresh: llama.cpp's llama-server, cellserve with no flags
(the fast setup for this CPU: the file's own blocks from 256 MiB up) and cellserve
`--quant none --dtype float32` (the dequantized weights in float32: the reference). The same
prompts go to each as token ids (the same tokens for all three), greedy, 32 tokens, with the
top-20 log-probabilities of every generated position (llama.cpp's `n_probs`, OpenAI's
`logprobs`). Per pair, over the positions where both generated the same tokens so far:
top-1 agreement (the same next token) and the KL divergence of the second's distribution from
the first's, over the first's top-20 (both renormalised to those tokens; a token missing from
the second's top-20 gets its 20th log-probability: an upper bound on what it had).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys

import httpx

from bench.models import resolve_model
from bench.server_proc import cellserve_process, llamacpp_default, served

PROMPTS = (
    "The history of the printing press begins",
    "def fibonacci(n):\n    ",
    "Water boils at a lower temperature on mountains because",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "A list of five fruits: apple,",
    "In 1969, the first humans",
    "SELECT name, COUNT(*) FROM orders",
    "The three laws of thermodynamics state that",
)
N_TOKENS = 32
TOP = 20


Position = tuple[int, dict[int, float]]  # (chosen token, {token: logprob} of the top 20)


def llamacpp_positions(url: str, ids: list[int]) -> list[Position]:
    body = {"prompt": ids, "n_predict": N_TOKENS, "temperature": 0, "n_probs": TOP,
            "cache_prompt": False, "return_tokens": True}  # fmt: skip
    out = httpx.post(f"{url}/completion", json=body, timeout=600).json()
    positions = []
    for p in out["completion_probabilities"]:
        top = {int(t["id"]): float(t["logprob"]) for t in p["top_logprobs"]}
        positions.append((int(p["id"]), top))
    return positions


def cellserve_positions(url: str, ids: list[int]) -> list[Position]:
    body = {"prompt": ids, "max_tokens": N_TOKENS, "temperature": 0, "logprobs": TOP,
            "ignore_eos": True, "return_tokens_as_token_ids": True}  # fmt: skip
    out = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()
    lp = out["choices"][0]["logprobs"]

    def tid(name: str) -> int:
        return int(name.removeprefix("token_id:"))

    return [
        (tid(token), {tid(t): v for t, v in top.items()})
        for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True)
    ]


def compare(a: list[list[Position]], b: list[list[Position]]) -> dict[str, float]:
    """b against a: top-1 agreement and mean KL(a || b) over a's top 20."""
    agree = n = 0
    kl_sum = 0.0
    for pa, pb in zip(a, b, strict=True):
        for (ta, top_a), (tb, top_b) in zip(pa, pb, strict=False):  # llama.cpp may stop early
            n += 1
            agree += ta == tb
            floor = min(top_b.values())
            la = _renorm(top_a)
            lb = _renorm({t: top_b.get(t, floor) for t in top_a})
            kl_sum += sum(math.exp(la[t]) * (la[t] - lb[t]) for t in la)
            if ta != tb:
                break  # the continuations differ from here
    return {"positions": n, "top1": round(agree / n, 4), "kl": round(kl_sum / n, 5)}


def _renorm(logprobs: dict[int, float]) -> dict[int, float]:
    z = math.log(sum(math.exp(v) for v in logprobs.values()))
    return {t: v - z for t, v in logprobs.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__)
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="packaged name or GGUF path")
    p.add_argument("--llamacpp", type=pathlib.Path, default=None)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results/fidelity"))
    args = p.parse_args(argv)
    model = resolve_model(args.model)
    assert model is not None
    args.out.mkdir(parents=True, exist_ok=True)
    llama = args.llamacpp or llamacpp_default()
    runs: dict[str, list[list[Position]]] = {}
    with cellserve_process(args.out / "reference.log", ["--model", str(model), "--quant",
                           "none", "--dtype", "float32", "--n-cells", "4096"]) as srv:  # fmt: skip
        prompts = [
            httpx.post(f"{srv.url}/tokenize", json={"prompt": t}).json()["tokens"] for t in PROMPTS
        ]
        runs["float32 reference"] = [cellserve_positions(srv.url, ids) for ids in prompts]
    with cellserve_process(args.out / "default.log", ["--model", str(model)]) as srv:
        runs["cellserve default"] = [cellserve_positions(srv.url, ids) for ids in prompts]
    threads = str(os.cpu_count() or 1)

    def llama_cmd(port: int) -> list[str]:
        return [str(llama), "-m", str(model), "-t", threads, "-c", "4096", "-np", "1",
                "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip

    with served(llama_cmd, args.out / "llamacpp.log", 300) as srv:
        runs["llama.cpp"] = [llamacpp_positions(srv.url, ids) for ids in prompts]
    pairs = [
        ("float32 reference", "cellserve default"),
        ("float32 reference", "llama.cpp"),
        ("llama.cpp", "cellserve default"),
    ]
    report = {f"{a} -> {b}": compare(runs[a], runs[b]) for a, b in pairs}
    report["model"] = str(model)
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    for name, r in report.items():
        print(f"{name:42s} {r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
