"""`python -m bench.kv_types_bench [--model NAME|PATH] [--tokens N] [--ctx N]`: what each KV
cache type (--cache-type-k / --cache-type-v) costs in accuracy, saves in bytes, and does to a
decode step at a long context, on the default runtime for this CPU (model.serving.open_model).

Accuracy: the prompts below, greedy, `--tokens` tokens each, all sequences in one batch. The f32
cache gives the reference tokens and logits; each type is then run teacher-forced on those
tokens (the same positions, the same context) for top-1 agreement and the mean KL(f32 || type)
over every position, and free-running for its own greedy completions, compared whole with the
f32 cache's and with the f16 cache's. Speed: one sequence decoding at position `--ctx` (cells
0..ctx-1 attended, their contents irrelevant to the time), each type's worker in turn, best of
`--rounds` interleaved rounds: only the ratio to the 16-bit default is worth reporting, on a
shared machine.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from model.kernels import isa

PROMPTS = (
    "def quicksort(arr):\n    ",
    "The history of the printing press begins",
    "import numpy as np\n\ndef normalize(x):\n    ",
    "Water boils at a lower temperature on mountains because",
    "SELECT customer_id, SUM(amount) FROM payments",
    "class LinkedList:\n    def __init__(self):\n        ",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "// A function that reverses a string in C\n",
    "In 1969, the first humans",
    "A list of five fruits: apple,",
    "#!/bin/bash\n# back up the home directory\n",
    "The three laws of thermodynamics state that",
    "fn main() {\n    let v: Vec<i32> = ",
    "Explain what a hash table is in one sentence:",
    "<html>\n<head>\n<title>",
    "To compute the derivative of x^2 sin(x),",
)
TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


def run_batch(worker: Any, ids: list[list[int]], n_tokens: int, forced: Any = None) -> Any:
    """Prefill every prompt, then n_tokens - 1 decode steps of all of them (feeding
    forced[:, step] when given, else each one's greedy token) -> logits [n_seq, n_tokens, vocab]
    (float32) and the tokens [n_seq, n_tokens] chosen greedily from them."""
    import torch

    from bench.model_bench import make_plan

    windows = worker.model.args.memory_spec.windows
    per_seq = max(map(len, ids)) + n_tokens + 1
    logits = worker.forward(make_plan(ids, [0] * len(ids), per_seq, windows))
    rows = [logits]
    for step in range(n_tokens - 1):
        feed = logits.argmax(-1) if forced is None else forced[:, step]
        plan = make_plan([[int(t)] for t in feed], [len(p) + step for p in ids], per_seq, windows)
        logits = worker.forward(plan)
        rows.append(logits)
    out = torch.stack(rows, dim=1)
    return out, out.argmax(-1)


def closeness(ref: Any, got: Any) -> dict[str, float]:
    import torch

    agree = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    kl = torch.nn.functional.kl_div(
        got.flatten(0, 1).log_softmax(-1),
        ref.flatten(0, 1).log_softmax(-1),
        log_target=True,
        reduction="batchmean",
    )
    return {"top1": round(agree, 4), "kl": float(f"{float(kl):.3g}")}


def decode_times(workers: dict[str, Any], ctx: int, rounds: int, steps: int) -> dict[str, float]:
    """Best seconds per decode step of one sequence at position ctx, per type."""
    from bench.model_bench import make_plan

    best = dict.fromkeys(workers, float("inf"))
    for _ in range(rounds):
        for name, worker in workers.items():
            windows = worker.model.args.memory_spec.windows
            plan = make_plan([[100]], [ctx], ctx + 2, windows)
            worker.forward(plan)  # warm
            start = time.perf_counter()
            for _ in range(steps):
                worker.forward(plan)
            best[name] = min(best[name], (time.perf_counter() - start) / steps)
    return best


def run(model: str, n_tokens: int, ctx: int, rounds: int) -> dict[str, Any]:
    import torch

    from bench.models import resolve_model
    from model.runner.worker import default_cache_type, make_worker
    from model.serving import open_model

    opened = open_model(str(resolve_model(model)), "cpu")
    loaded = opened.loaded
    ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
    per_seq = max(map(len, ids)) + n_tokens + 1
    n_cells = len(ids) * per_seq
    out: dict[str, Any] = {
        "model": loaded.name,
        "runtime": {"dtype": str(loaded.transformer.dtype), "quant": opened.runtime.quant},
        "isa": isa.active_level(),
        "default_cache_type": default_cache_type(loaded.transformer.dtype),
        "prompts": len(ids),
        "tokens": n_tokens,
        "types": {},
    }
    torch.set_num_threads(torch.get_num_threads())
    with torch.inference_mode():
        ref_worker = make_worker(loaded, n_cells, cache_type_k="f32", cache_type_v="f32")
        ref_logits, ref_tokens = run_batch(ref_worker, ids, n_tokens)
        del ref_worker
        free: dict[str, Any] = {}
        for name in TYPES:
            worker = make_worker(loaded, n_cells, cache_type_k=name, cache_type_v=name)
            forced, _ = run_batch(worker, ids, n_tokens, forced=ref_tokens)
            _, free[name] = run_batch(worker, ids, n_tokens)
            row = closeness(ref_logits, forced)
            row["bytes_per_cell"] = worker.kv_bytes_per_cell
            row["paths"] = worker.paths.describe()
            out["types"][name] = row
            del worker, forced
        for name, tokens in free.items():
            row = out["types"][name]
            row["greedy_same_as_f32"] = int((tokens == free["f32"]).all(-1).sum())
            row["greedy_same_as_f16"] = int((tokens == free["f16"]).all(-1).sum())
        if ctx:
            workers = {
                name: make_worker(loaded, ctx + 2, cache_type_k=name, cache_type_v=name)
                for name in (out["default_cache_type"], "q8_0", "q4_0")
            }
            secs = decode_times(workers, ctx, rounds, steps=5)
            base = secs[out["default_cache_type"]]
            out["decode_at_ctx"] = {
                "ctx": ctx,
                "ms_per_step": {k: round(v * 1e3, 2) for k, v in secs.items()},
                "ratio_to_default": {k: round(v / base, 3) for k, v in secs.items()},
                "note": "measured under load: a ratio, side by side in one run",
            }
    return out


def main() -> None:
    isa.apply_forced_isa()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=4096, help="0: no decode timing")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(run(args.model, args.tokens, args.ctx, args.rounds), indent=2))


if __name__ == "__main__":
    main()
