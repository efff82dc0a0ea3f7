"""`python -m bench.step_bench [--model NAME|PATH] [--rows N] [--decode C] [--steps S]`: the
worker alone, built as `cellserve serve` builds it (model.serving.open_model, then make_worker):
the median time of a prompt step of N rows (two sequences of N / 2 tokens), of a step of C decode
rows (one token for each of C sequences) and of a one-row decode step, on this process's ISA path
(CELLSERVE_ISA forces another). Random token ids; every step writes its cells again at the same
positions, so only the first round touches new KV pages. The server's per-request work (HTTP,
scheduling, sampling of many requests) is not in these numbers: they say what the C++ step costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from model.kernels import isa


def run(model: str | None, rows: int, decode: int, steps: int) -> dict[str, Any]:
    isa.apply_forced_isa()
    from bench.model_bench import make_plan, prompts
    from bench.models import resolve_model
    from model.runner.worker import make_worker
    from model.serving import open_model

    if rows < 2 or decode < 1 or steps < 1:
        raise ValueError("--rows >= 2, --decode >= 1, --steps >= 1")
    rows -= rows % 2  # two sequences of rows / 2 tokens
    opened = open_model(resolve_model(model), "cpu")
    loaded = opened.loaded
    per_seq = rows // 2 + steps + 8
    worker = make_worker(loaded, n_cells=max(decode, 2) * per_seq + 1)
    vocab = loaded.config.vocab_size
    windows = worker.model.args.memory_spec.windows

    def median_ms(plan_of: Any) -> float:
        worker.execute(plan_of())  # warm-up: first touch of the cells' pages
        times = []
        for _ in range(steps):
            plan = plan_of()
            start = time.perf_counter()
            worker.execute(plan)
            times.append(time.perf_counter() - start)
        return round(statistics.median(times) * 1e3, 2)

    chunk = prompts(2, rows // 2, vocab)
    prompt_ms = median_ms(lambda: make_plan(chunk, [0, 0], per_seq, windows))
    ids = prompts(decode, 1, vocab)
    decode_ms = median_ms(lambda: make_plan(ids, [8] * decode, per_seq, windows))
    one_ms = median_ms(lambda: make_plan(ids[:1], [8], per_seq, windows))
    return {
        "model": loaded.name,
        "isa": opened.isa,
        "kernels": opened.kernels,
        "runtime": {"dtype": opened.runtime.dtype, "quant": opened.runtime.quant},
        "native_step": worker.paths.native is not None,
        "prompt": {
            "rows": rows,
            "ms": prompt_ms,
            "rows_per_s": round(rows * 1e3 / prompt_ms, 1),
        },
        "decode": {
            "rows": decode,
            "ms": decode_ms,
            "rows_per_s": round(decode * 1e3 / decode_ms, 1),
        },
        "decode_one": {"ms": one_ms},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default=None, help="a packaged model's name, a benchmark model's or a path"
    )
    ap.add_argument(
        "--rows", type=int, default=512, help="rows of the prompt step (the default n_batch)"
    )
    ap.add_argument("--decode", type=int, default=32, help="decode rows of the many-sequence step")
    ap.add_argument("--steps", type=int, default=8, help="steps timed per kind (median)")
    args = ap.parse_args()
    print(json.dumps(run(args.model, args.rows, args.decode, args.steps), indent=1))


if __name__ == "__main__":
    main()
