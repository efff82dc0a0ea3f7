"""`python -m bench.radix_bench [--conversations 1000] [--prompt-len 300] [--out DIR]`: the prefix
index over held cells (scheduler/radix.py), measured on the scheduler with a stand-in worker.

1. Recall: `--conversations` distinct conversations of `--prompt-len` prompt tokens, each
   answered (`--answer-len` tokens), then each continued once (its history + `--turn-len` new
   tokens) after all have been seen, with `--n-seq-max` seq ids and `--n-cells` enough for all.
   Reported per setting (prefix index on / off: off is the holders-only cache of before):
   continuations whose cached tokens are >= 90% of their history, and the mean hit ratio.
   `--window W` gives the model a sliding-window layer beside a full one (the iSWA memory, as
   Gemma 3's): the index also keeps each conversation's window, within `--swa-index-cells`
   (0: enough for every conversation's).
2. Matching cost: RadixCache.match (what runs on the engine thread at every admission) against
   a tree of N conversations (`--match-sizes`), distinct or under one shared system prompt,
   next to the flat holder scan (PrefixCache.match) over N holders.

The worker samples a hash of each row's position and seq id, so no model runs: the numbers are
the scheduler's. Prefill and decode tokens are counted as the worker sees them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import time
from typing import Any

import numpy as np

from kvcache.spec import Attention, MemorySpec
from scheduler.config import EngineConfig
from scheduler.plan import BatchPlan, SamplingParams, StepOutput
from scheduler.prefix_cache import PrefixCache
from scheduler.radix import RadixCache
from scheduler.request import FinishEvent, Request, TokenEvent
from scheduler.scheduler import Scheduler

VOCAB = 32_000


class HashWorker:
    def execute(self, plan: BatchPlan) -> StepOutput:
        out = [
            (int(plan.positions[s.row]) * 7919 + int(plan.token_ids[s.row]) * 31) % VOCAB + 1
            for s in plan.samples
        ]
        return StepOutput(token_ids=out)


def serve(sched: Scheduler, worker: HashWorker, req: Request) -> tuple[list[int], FinishEvent]:
    sched.add_request(req)
    tokens: list[int] = []
    finish = None
    while sched.has_work:
        plan = sched.schedule()
        out = worker.execute(plan) if plan.num_tokens else StepOutput(token_ids=[])
        for _, ev in sched.update(plan, out):
            if isinstance(ev, TokenEvent):
                tokens.append(ev.token_id)
            elif isinstance(ev, FinishEvent):
                finish = ev
    assert finish is not None
    return tokens, finish


def request(req_id: str, prompt: list[int], max_tokens: int) -> Request:
    sampling = SamplingParams(temperature=0.0)
    return Request(req_id, prompt, max_tokens=max_tokens, sampling=sampling, ignore_eos=True)


def recall(args: argparse.Namespace, index: bool) -> dict[str, Any]:
    rng = random.Random(0)
    n_conv, n_prompt = args.conversations, args.prompt_len
    # a conversation after its continuation: prompt, answer, turn, answer (+1 unfed token each)
    per_conv = n_prompt + 2 * args.answer_len + args.turn_len + 2
    n_cells = args.n_cells or (n_conv + args.n_seq_max) * per_conv
    spec, index_cells = None, None
    if args.window:
        spec = MemorySpec.of([Attention(1, 4), Attention(1, 4, args.window)])
        index_cells = args.swa_index_cells or 2 * n_conv * min(per_conv, args.window)
    config = EngineConfig(
        n_cells=n_cells,
        n_seq_max=args.n_seq_max,
        n_batch=512,
        n_ctx_seq=2 * per_conv,
        seed=0,
        prefix_index=index,
        memory_spec=spec,
        swa_index_cells=index_cells,
    )
    sched, worker = Scheduler(config), HashWorker()
    prompts = [[rng.randrange(1, VOCAB) for _ in range(n_prompt)] for _ in range(n_conv)]
    t0 = time.perf_counter()
    answers = [
        serve(sched, worker, request(f"a{i}", p, args.answer_len))[0] for i, p in enumerate(prompts)
    ]
    t_first = time.perf_counter() - t0
    ratios = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        turn = [rng.randrange(1, VOCAB) for _ in range(args.turn_len)]
        _, fin = serve(sched, worker, request(f"b{i}", p + answers[i] + turn, args.answer_len))
        ratios.append(fin.num_cached_tokens / (n_prompt + args.answer_len))
    t_second = time.perf_counter() - t0
    radix = sched.seq_ids.radix
    return {
        "prefix_index": index,
        "n_cells": n_cells,
        "n_seq_max": args.n_seq_max,
        "window": args.window,
        "swa_pool_cells": sched.memory.pools[1].cells.n_cells if args.window else 0,
        "conversations": n_conv,
        "continuations_hit_ge_90pct": sum(r >= 0.9 for r in ratios),
        "mean_hit_ratio": round(float(np.mean(ratios)), 4),
        "index_nodes": radix.num_nodes if radix else 0,
        "index_cells": radix.num_cells if radix else 0,
        "first_turns_s": round(t_first, 2),
        "continuations_s": round(t_second, 2),
    }


class _NoCells:
    """A memory stand-in for the matching benchmark: holds nothing, has no window pools."""

    index_windows: tuple[int, ...] = ()
    index_budget: tuple[int, ...] = ()
    pools: list[Any] = []

    def cells_hold(self, cells: np.ndarray, pool: int = 0) -> None:
        pass


def match_cost(n: int, prompt_len: int, shared: int, repeat: int) -> dict[str, Any]:
    rng = np.random.default_rng(n)
    system = rng.integers(1, VOCAB, shared)
    convs = [
        np.concatenate([system, rng.integers(1, VOCAB, prompt_len - shared)]) for _ in range(n)
    ]
    radix = RadixCache(_NoCells())  # type: ignore[arg-type]
    flat = PrefixCache()
    t0 = time.perf_counter()
    for i, c in enumerate(convs):
        radix.insert(c, np.arange(i * prompt_len, (i + 1) * prompt_len, dtype=np.int64))
        flat.insert(i, c)
    t_insert = (time.perf_counter() - t0) / n
    queries = [
        np.concatenate([convs[int(j)], rng.integers(1, VOCAB, 20)])
        for j in rng.integers(0, n, repeat)
    ]
    t0 = time.perf_counter()
    for q in queries:
        assert radix.match(q).length == prompt_len
    t_radix = (time.perf_counter() - t0) / repeat
    flat_repeat = max(1, repeat // 10)
    t0 = time.perf_counter()
    for q in queries[:flat_repeat]:
        assert flat.match(q).length == prompt_len
    t_flat = (time.perf_counter() - t0) / flat_repeat
    return {
        "entries": n,
        "shared_prefix": shared,
        "radix_nodes": radix.num_nodes,
        "radix_match_us": round(t_radix * 1e6, 1),
        "radix_insert_us": round(t_insert * 1e6, 1),
        "flat_match_us": round(t_flat * 1e6, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--conversations", type=int, default=1000)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--answer-len", type=int, default=16)
    ap.add_argument("--turn-len", type=int, default=20)
    ap.add_argument("--n-seq-max", type=int, default=8)
    ap.add_argument("--n-cells", type=int, default=0, help="0: enough for every conversation")
    ap.add_argument("--window", type=int, default=0, help="a sliding-window layer of W (iSWA)")
    ap.add_argument("--swa-index-cells", type=int, default=0, help="0: enough for all")
    ap.add_argument("--match-sizes", default="1000,10000")
    ap.add_argument("--skip-off", action="store_true", help="skip the holders-only run")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    results: dict[str, Any] = {"recall": [], "match": []}
    for index in (True, False)[: 1 if args.skip_off else 2]:
        results["recall"].append(recall(args, index))
        print(json.dumps(results["recall"][-1]), flush=True)
    for n in (int(x) for x in args.match_sizes.split(",")):
        for shared in (0, 200):
            results["match"].append(match_cost(n, args.prompt_len, shared, repeat=2000))
            print(json.dumps(results["match"][-1]), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "radix_bench.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
