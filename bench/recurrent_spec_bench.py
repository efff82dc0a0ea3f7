"""`python -m bench.recurrent_spec_bench`: the target's side of speculative decoding on recurrent
and hybrid models, beside an attention model: what a step that verifies k drafted tokens costs
against a decode step, and so what an acceptance rate buys.

A recurrent state consumes the drafts for good, so the verifying step leaves a checkpoint of the
state before each drafted row (Memory.plan's `rollback`: one whole-state copy per draft) and the
scan splits at each; that is the cost measured here, beside the same rows read as a prompt chunk
(one checkpoint). No recurrent weights can be installed here: the Mamba2 and the Granite
4.0-H-like hybrid are bench/recurrent_bench.py's random models (their cost is that of real
ones), the attention model the packaged SmolLM2-135M, all at the server's default dtype and
weight quantization. One sequence with `context` tokens placed (not computed: the cost does not
depend on the values), then per k the median of `steps` steps of 1 + k rows; after each, the
drafts are rejected (seq_rm back to the checkpoint, Memory.seq_commit), as a round that accepts
nothing leaves it. A round that accepts a drafts emits a + 1 tokens in one step: its speed
against decoding is (a + 1) x decode_ms / verify_ms(k); `break_even` is the a where that is 1.
The draft's own cost (n-gram lookup: none; a draft model: its forwards) is not counted.
"""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bench.placement import place_rows
from bench.recurrent_bench import Sizes, hybrid_args, mamba2_args, model_parser, random_model
from bench.report import write_json


@dataclass(slots=True)
class VerifyCost:
    model: str
    k: int  # drafted tokens verified in the step (0: a decode step)
    verify_ms: float  # the step, with a checkpoint before each draft
    chunk_ms: float  # the same rows read as a prompt chunk (no rollback checkpoints)
    break_even: float  # accepted drafts per round at which speculation pays for the step


def bench_model(
    name: str, loaded: Any, dtype: str, ks: tuple[int, ...], context: int, steps: int
) -> list[VerifyCost]:
    from kvcache.make import make_memory
    from model.runner.worker import make_worker

    n_cells = context + (steps + 1) * sum(2 * k + 3 for k in ks) + 64  # every step's rows
    # the server's default checkpoint slots: n_seq_max beside one per sequence
    memory = make_memory(loaded.config.memory_spec, n_cells, 16, 512)
    group_cells = [memory.pools[i].cells.n_cells for i in memory.group_pools]
    worker = make_worker(loaded, n_cells, dtype, group_cells=group_cells)
    for p0 in range(0, context, 512):
        place_rows(memory, [(0, [5] * min(512, context - p0), p0)])
    pos = context

    def step_ms(k: int, rollback: bool) -> float:
        nonlocal pos
        times = []
        for _ in range(steps + 1):
            plan = place_rows(memory, [(0, [7] * (k + 1), pos)], [0] if rollback else None)
            t = time.perf_counter()
            worker.execute(plan)
            times.append(time.perf_counter() - t)
            if rollback:  # every draft rejected: back to the state after the first row
                assert memory.seq_rm(0, pos + 1, -1)
                memory.seq_commit(0)
                pos += 1
            else:
                pos += k + 1
        return 1e3 * float(np.median(times[1:]))  # the first step warms up

    out = []
    decode = step_ms(0, False)
    for k in ks:
        verify = decode if k == 0 else step_ms(k, True)
        chunk = decode if k == 0 else step_ms(k, False)
        out.append(VerifyCost(name, k, verify, chunk, verify / decode - 1))
        print(format_cost(out[-1]), flush=True)
    return out


def run(
    out_dir: str | pathlib.Path | None = None,
    sizes: Sizes | None = None,
    dtype: str = "bfloat16",
    quant: str = "int4",
    ks: tuple[int, ...] = (0, 1, 2, 4, 8, 16),
    context: int = 512,
    steps: int = 9,
    threads: int | None = None,
) -> dict[str, Any]:
    import torch

    from model.layers.quant import quantize
    from model.load.loader import default_model_path, load_model
    from model.runner.worker import set_torch_threads

    sizes = sizes or Sizes()
    set_torch_threads(threads or os.cpu_count() or 1)
    models: dict[str, Callable[[], Any]] = {
        "mamba2": lambda: random_model(mamba2_args(sizes)),
        "hybrid": lambda: random_model(hybrid_args(sizes)),
        "smollm2-135m": lambda: load_model(default_model_path(), dtype=dtype),
    }
    costs = []
    for name, make in models.items():
        loaded = make()
        loaded.transformer.to(getattr(torch, dtype))
        quantize(loaded.transformer, quant)
        costs += bench_model(name, loaded, dtype, ks, context, steps)
    report = {
        "dtype": dtype,
        "quant": quant,
        "threads": torch.get_num_threads(),
        "sizes": asdict(sizes),
        "context": context,
        "costs": [asdict(c) for c in costs],
    }
    if out_dir is not None:
        write_json(pathlib.Path(out_dir) / "recurrent_spec_bench.json", report)
    return report


def format_cost(c: VerifyCost) -> str:
    return (
        f"| {c.model} | {c.k:>2} | {c.verify_ms:7.1f} | {c.chunk_ms:7.1f} | {c.break_even:5.2f} |"
    )


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--context", type=int, default=512)
    a = parser.parse_args()
    print("| model | k | verify ms | as a prompt chunk ms | break-even accepted |")
    print("|---|---|---|---|---|")
    run(a.out, None, a.dtype, a.quant, context=a.context, threads=a.threads)


if __name__ == "__main__":
    main()
