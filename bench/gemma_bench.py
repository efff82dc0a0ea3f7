"""`python -m bench.gemma_bench`: Gemma-3-270M (sliding window 512) at 2,000-token contexts.

For each memory layout the worker supports (MEMORIES) and each number of sequences (8, 32):
prefill tok/s (distinct 2,000-token prompts in 512-token chunks, one sequence after another),
then decode tok/s (every sequence one token per step, over its 2,000 cached tokens), and the
KV memory one sequence holds at that context. The KV bytes of both layouts come from the
model's memory spec: a full cache keeps every token for every layer; iSWA keeps the 3 global
layers' tokens and, for the 15 sliding layers, only the window (+ one step's tokens).

NOTE: on a 2-core CPU, 32 distinct 2,000-token prefills take minutes, so the 32-sequence run
prefills `distinct` prompts and forks them (seq_cp, as the prefix cache does): decode work per
sequence is the same as with private cells (each reads its own 2,000 cells by index).
bench/run.py calls run() only when the Gemma packages are installed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bench.placement import place_rows
from kvcache.make import make_memory
from kvcache.spec import Attention, MemorySpec


@dataclass(slots=True)
class Sizes:
    num_seqs: tuple[int, ...] = (8, 32)
    context: int = 2000
    distinct: int = 8  # distinct prompts prefilled; the rest are forks of them
    decode_steps: int = 16
    chunk: int = 512  # prefill tokens per step (the server's n_batch)


@dataclass(slots=True)
class Result:
    memory: str
    num_seqs: int
    context: int
    prefill_tok_s: float
    decode_tok_s: float
    decode_step_ms: float
    kv_bytes_per_seq: int
    kv_bytes_per_seq_full: int  # every layer keeps every token


def kv_bytes_per_seq(spec: MemorySpec, context: int, element: int, step: int = 0) -> int:
    """K + V bytes one sequence holds: a sliding layer keeps at most window + `step` tokens."""
    total = 0
    for layer in spec.layers:
        if isinstance(layer, Attention):
            kept = context if layer.window == 0 else min(context, layer.window + step)
            total += 2 * kept * layer.n_kv_heads * layer.head_dim * element
    return total


def full_spec(spec: MemorySpec) -> MemorySpec:
    return MemorySpec.of(
        [
            Attention(s.n_kv_heads, s.head_dim) if isinstance(s, Attention) else s
            for s in spec.layers
        ]
    )


def bench_memory(kind: str, loaded: Any, num_seqs: int, sizes: Sizes, dtype: str) -> Result:
    """`kind` "unified": every layer keeps every token, windows read through their ranges;
    "iswa": the sliding layers on a pool of window x sequences + chunk cells."""
    import torch

    from model.runner.worker import make_worker

    ctx = sizes.context
    n_cells = num_seqs * (ctx + sizes.decode_steps) + 64
    spec = loaded.config.memory_spec
    memory = make_memory(spec, n_cells, num_seqs + 1, sizes.chunk, kind)
    group_cells = [memory.pools[i].cells.n_cells for i in memory.group_pools]
    worker = make_worker(loaded, n_cells, dtype, group_cells=group_cells)
    rng = np.random.default_rng(0)
    vocab = loaded.config.vocab_size
    distinct = min(num_seqs, sizes.distinct)
    last: dict[int, int] = {}
    t0 = time.perf_counter()
    for seq in range(distinct):
        prompt = rng.integers(1000, vocab - 1000, ctx).tolist()
        for p0 in range(0, ctx, sizes.chunk):
            out = worker.execute(place_rows(memory, [(seq, prompt[p0 : p0 + sizes.chunk], p0)]))
        last[seq] = out.token_ids[0]
    prefill_s = time.perf_counter() - t0
    for seq in range(distinct, num_seqs):
        memory.seq_cp(seq % distinct, seq, -1, -1)
        last[seq] = last[seq % distinct]
    times = []
    for i in range(sizes.decode_steps):
        plan = place_rows(memory, [(s, [last[s]], ctx + i) for s in range(num_seqs)])
        t = time.perf_counter()
        out = worker.execute(plan)
        times.append(time.perf_counter() - t)
        last = dict(enumerate(out.token_ids))
    step_s = float(np.median(times[1:]))  # the first step warms the kernels up
    element = torch.empty(0, dtype=worker.kv[0].dtype).element_size()
    full = kv_bytes_per_seq(full_spec(spec), ctx, element)
    held = full if kind == "unified" else kv_bytes_per_seq(spec, ctx, element, 1)
    prefill_tok_s = distinct * ctx / prefill_s
    return Result(kind, num_seqs, ctx, prefill_tok_s, num_seqs / step_s, 1e3 * step_s, held, full)


# memory layout -> bench function
MEMORIES: dict[str, Callable[[Any, int, Sizes, str], Result]] = {
    kind: functools.partial(bench_memory, kind) for kind in ("unified", "iswa")
}


def run(
    out_dir: str | pathlib.Path | None = None,
    sizes: Sizes | None = None,
    dtype: str = "bfloat16",
    quant: str = "int4",
    threads: int | None = None,
) -> dict[str, Any]:
    """`threads`: torch threads of the model steps (default: every core)."""
    import torch

    from model.layers.quant import quantize
    from model.load.loader import load_model
    from model.load.packaged import gemma3_270m_path, gemma3_installed
    from model.runner.worker import set_torch_threads

    if not gemma3_installed():
        return {"skipped": "the Gemma-3-270M packages are not installed"}
    sizes = sizes or Sizes()
    set_torch_threads(threads or os.cpu_count() or 1)
    loaded = load_model(gemma3_270m_path(), dtype=dtype)
    quantize(loaded.transformer, quant)
    spec = loaded.config.memory_spec
    element = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    results = []
    for bench in MEMORIES.values():
        for n in sizes.num_seqs:
            results.append(bench(loaded, n, sizes, dtype))
            print(format_result(results[-1]), flush=True)
    report: dict[str, Any] = {
        "model": loaded.name,
        "dtype": dtype,
        "quant": quant,
        "threads": torch.get_num_threads(),
        "sizes": asdict(sizes),
        # what each layout would hold per sequence at this context (the memory spec's count)
        "kv_bytes_per_seq_full": kv_bytes_per_seq(full_spec(spec), sizes.context, element),
        "kv_bytes_per_seq_iswa": kv_bytes_per_seq(spec, sizes.context, element, sizes.chunk),
        "results": [asdict(r) for r in results],
    }
    if out_dir is not None:
        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gemma_bench.json").write_text(json.dumps(report, indent=2))
    return report


def format_result(r: Result) -> str:
    return (
        f"| {r.memory} | {r.num_seqs:>3} | {r.context} | {r.prefill_tok_s:8.1f} "
        f"| {r.decode_tok_s:8.1f} | {r.decode_step_ms:7.1f} | {r.kv_bytes_per_seq / 2**20:6.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quant", default="int4")
    parser.add_argument("--num-seqs", default="8,32")
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="default: every core")
    args = parser.parse_args()
    sizes = Sizes(
        num_seqs=tuple(int(x) for x in args.num_seqs.split(",")),
        context=args.context,
        decode_steps=args.decode_steps,
    )
    print("| memory | seqs | context | prefill tok/s | decode tok/s | step ms | KV MiB/seq |")
    print("|---|---|---|---|---|---|---|")
    report = run(args.out, sizes, args.dtype, args.quant, args.threads)
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=2))


if __name__ == "__main__":
    main()
