"""`python -m bench.constrained_bench`: the cost of structured outputs, engine without HTTP.

1. Output tokens/s at each concurrency, unconstrained vs every request under a JSON Schema,
   greedy, the same prompts and the same number of output tokens (the schema's array needs
   more items than `output_len`, so every choice runs to max_tokens): the ratio is the cost
   of computing, applying and advancing the token masks. Runs alternate between the two
   modes `rounds` times; the best run of each mode is reported.
2. Compile time: llguidance's tokenizer view (once per model), then a cold compile of each
   schema and its first mask.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from bench.engine_bench import random_prompt, serve
from model.runner.worker import make_worker
from scheduler.config import EngineConfig
from scheduler.constraint import Grammar
from scheduler.plan import SamplingParams
from scheduler.request import Request

BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "scores": {"type": "array", "items": {"type": "integer"}, "minItems": 512},
    },
    "required": ["name", "age", "color", "scores"],
    "additionalProperties": False,
}
LARGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        f"field_{i}": {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "label": {"type": "string", "pattern": "^[a-z]{3,12}$"},
                "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                "when": {"type": "string", "format": "date-time"},
            },
            "required": ["id", "label", "kind"],
        }
        for i in range(24)
    },
    "required": [f"field_{i}" for i in range(24)],
}


@dataclass(slots=True)
class Sizes:
    levels: tuple[int, ...] = (1, 32)
    prompt_len: int = 64
    output_len: int = 64
    rounds: int = 2


@dataclass(slots=True)
class LevelResult:
    level: int
    plain_tok_s: float
    json_tok_s: float
    slowdown: float  # 1 - json / plain


def make_request(
    req_id: str, prompt: list[int], max_tokens: int, grammar: Grammar | None
) -> Request:
    return Request(
        req_id,
        prompt,
        SamplingParams(temperature=0.0),
        max_tokens=max_tokens,
        ignore_eos=True,
        grammar=grammar,
    )


def run(
    out_dir: str | pathlib.Path | None = None,
    sizes: Sizes | None = None,
    quant: str = "none",
    dtype: str = "float32",
) -> dict[str, Any]:
    from model.layers.quant import quantize
    from model.load.loader import default_model_path, load_model
    from model.runner.grammar import GrammarCompiler, GrammarSpec

    sizes = sizes or Sizes()
    loaded = load_model(default_model_path(), dtype=dtype)
    if quant != "none":
        quantize(loaded.transformer, quant)
    compile_ms = _compile_times(loaded, GrammarCompiler, GrammarSpec)
    compiler = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size)
    grammar = compiler.compile(GrammarSpec.json_schema(BENCH_SCHEMA))

    vocab = loaded.tokenizer.vocab_size
    level_max = max(sizes.levels)
    n_cells = level_max * (sizes.prompt_len + sizes.output_len) + 256
    worker = make_worker(loaded, n_cells)
    config = EngineConfig(
        n_cells=n_cells,
        n_seq_max=level_max + 8,
        n_batch=512,
        n_ctx_seq=1024,
        max_queue=1024,
        prefix_cache=False,
    )
    rng = random.Random(0)
    serve(worker, config, [[make_request("warmup", random_prompt(rng, 16, vocab), 4, grammar)]])
    results: list[LevelResult] = []
    for level in sizes.levels:
        prompts = [random_prompt(rng, sizes.prompt_len, vocab) for _ in range(level)]
        best = {"plain": 0.0, "json": 0.0}
        for _ in range(sizes.rounds):
            for mode in ("plain", "json"):
                g = grammar if mode == "json" else None
                batch = [
                    make_request(f"{mode}{i}", p, sizes.output_len, g)
                    for i, p in enumerate(prompts)
                ]
                (timings,), (wall,), _, _ = serve(worker, config, [batch])
                num_tokens = sum(len(t.tokens) for t in timings)
                assert num_tokens == level * sizes.output_len, "every choice runs to max_tokens"
                best[mode] = max(best[mode], num_tokens / wall)
        result = LevelResult(level, best["plain"], best["json"], 1 - best["json"] / best["plain"])
        results.append(result)
        print(format_level(result), flush=True)

    overhead = _step_overhead(loaded, grammar, level_max)
    print(json.dumps(overhead, indent=2), flush=True)
    report: dict[str, Any] = {
        # first: what bench/summary.py shows in its micro-benchmark table
        "slower_by": {f"c{r.level}": round(r.slowdown, 4) for r in results},
        "compile_ms": compile_ms,
        "model": loaded.name,
        "dtype": dtype,
        "quant": quant,
        "sizes": asdict(sizes),
        "levels": [asdict(r) for r in results],
        "step_overhead_ms": overhead,
    }
    if out_dir is not None:
        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "constrained_bench.json").write_text(json.dumps(report, indent=2))
    return report


def _step_overhead(loaded: Any, grammar: Grammar, n: int, repeats: int = 50) -> dict[str, float]:
    """Per step of `n` rows, in the array of the bench schema: the mask fill, and sampling
    with masks (worst case: random logits, so no row's argmax is allowed and every row
    searches its allowed ids; best case: each row's argmax allowed) vs without."""
    import torch

    from model.runner.sampling import sample
    from model.runner.token_mask import MaskFiller
    from scheduler.plan import SampleRow

    prefix = loaded.tokenizer.encode(
        '{"name": "Al", "age": 3, "color": "red", "scores": [1, 2', False
    )
    rows, plain = [], []
    for i in range(n):
        constraint = grammar.new_constraint()
        assert all(constraint.advance(t) is None for t in prefix)
        params = SamplingParams(temperature=0.0)
        rows.append(SampleRow(i, params, 0, 0, 1, constraint=constraint))
        plain.append(SampleRow(i, params, 0, 0, 1))
    vocab = loaded.config.vocab_size
    random_logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0))
    digit = loaded.tokenizer.encode("5", False)[0]
    following = random_logits.clone()
    following[:, digit] = 100.0
    filler = MaskFiller(vocab)

    def timed(fn: Any) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return 1e3 * (time.perf_counter() - t0) / repeats

    future = filler.start(rows)
    assert future is not None
    masks = future.result()
    return {
        "rows": n,
        "mask_fill": timed(lambda: filler.start(rows).result()),  # type: ignore[union-attr]
        "sample_plain": timed(lambda: sample(random_logits, plain)),
        "sample_masked_worst": timed(lambda: sample(random_logits, rows, masks)),
        "sample_masked_best": timed(lambda: sample(following, rows, masks)),
    }


def _compile_times(loaded: Any, compiler_cls: Any, spec_cls: Any) -> dict[str, float]:
    """Cold: a fresh compiler per schema (no cache), the first mask included."""
    import numpy as np
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    t0 = time.perf_counter()
    compiler = compiler_cls(loaded.tokenizer, loaded.config.vocab_size)
    _ = compiler.ll_tokenizer
    out = {"tokenizer_view": 1e3 * (time.perf_counter() - t0)}
    for name, schema in (("bench_schema", BENCH_SCHEMA), ("large_schema", LARGE_SCHEMA)):
        compiler._cache.clear()
        t0 = time.perf_counter()
        grammar = compiler.compile(spec_cls.json_schema(schema))
        t1 = time.perf_counter()
        bitmask = allocate_token_bitmask(1, loaded.config.vocab_size)
        fill_next_token_bitmask(grammar.new_constraint().matcher, bitmask)
        t2 = time.perf_counter()
        assert np.any(bitmask != 0)
        out[f"{name}_compile"] = 1e3 * (t1 - t0)
        out[f"{name}_first_mask"] = 1e3 * (t2 - t1)
    return out


def format_level(r: LevelResult) -> str:
    return (
        f"| {r.level:>3} | {r.plain_tok_s:8.1f} | {r.json_tok_s:8.1f} | {100 * r.slowdown:6.2f}% |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--levels", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quant", default="none", choices=["none", "int8", "int4"])
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    sizes = Sizes(
        tuple(int(x) for x in args.levels.split(",")),
        args.prompt_len,
        args.output_len,
        args.rounds,
    )
    print(f"sizes: {sizes}")
    print("| seqs | plain out tok/s | json_schema out tok/s | slower by |")
    print("|---|---|---|---|")
    report = run(args.out, sizes, quant=args.quant, dtype=args.dtype)
    print(json.dumps(report["compile_ms"], indent=2))


if __name__ == "__main__":
    main()
