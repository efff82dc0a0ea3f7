"""`python -m bench.engine_bench`: the engine without HTTP, real worker on SmolLM2-135M.

1. Throughput sweep: `level` requests submitted at once (random prompts of `prompt_len`
   tokens, `output_len` output tokens, ignore_eos): total output tok/s, mean TTFT and mean
   time per output token (after the first) per level.
2. Shared system prompt: one warm-up request, then `num_shared` concurrent requests with the
   same `system_len`-token prefix and a private suffix, prefix cache on vs off: mean TTFT and
   the off/on ratio.
3. The scheduler's share of step time (schedule() + update() over the whole step) at the
   highest level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from model.runner.worker import make_worker
from scheduler.config import EngineConfig
from scheduler.engine import Engine, Worker
from scheduler.plan import SamplingParams
from scheduler.request import FinishEvent, Request, TokenEvent
from scheduler.stats import StepStats


@dataclass(slots=True)
class Timing:
    submit: float
    tokens: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.tokens[0] - self.submit

    @property
    def tpot(self) -> float | None:
        n = len(self.tokens)
        return (self.tokens[-1] - self.tokens[0]) / (n - 1) if n > 1 else None


@dataclass(slots=True)
class LevelResult:
    level: int
    wall_s: float
    output_tok_s: float
    mean_ttft_ms: float
    mean_tpot_ms: float
    sched_share: float  # schedule+update time / step time
    mean_sched_ms: float  # schedule+update per step
    num_steps: int


@dataclass(slots=True)
class Sizes:
    levels: tuple[int, ...] = (1, 8, 32, 64)
    prompt_len: int = 256
    output_len: int = 128
    system_len: int = 1000
    num_shared: int = 16
    shared_output_len: int = 8


# NOTE: a 2-core CPU reads ~100-300 prompt tokens/s with SmolLM2-135M in float32, so the CPU
# run shrinks prompts and outputs to stay within ~5 minutes; a GPU runs the full sizes.
FULL = Sizes()
CPU = Sizes(prompt_len=64, output_len=32, num_shared=4, shared_output_len=4)


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


async def _drive(engine: Engine, requests: list[Request]) -> list[Timing]:
    async def one(req: Request) -> Timing:
        t = Timing(time.perf_counter())
        async for ev in engine.submit(req):
            if isinstance(ev, TokenEvent):
                t.tokens.append(time.perf_counter())
            elif isinstance(ev, FinishEvent) and ev.reason not in ("length", "stop"):
                raise RuntimeError(f"{req.req_id} finished with {ev.reason}: {ev.error}")
        return t

    return await asyncio.gather(*[one(r) for r in requests])


def serve(
    worker: Worker, config: EngineConfig, batches: list[list[Request]], memory: Any = None
) -> tuple:
    """Runs each batch concurrently, one batch after the other, on a fresh engine (over
    `memory`, the kvcache.memory.Memory the worker's storage was sized for; None: the
    config's)."""
    steps: list[StepStats] = []
    engine = Engine(worker, config, on_step=steps.append, memory=memory)
    engine.start()
    timings: list[list[Timing]] = []
    walls: list[float] = []
    try:
        for batch in batches:
            steps.clear()
            t0 = time.perf_counter()
            timings.append(asyncio.run(_drive(engine, batch)))
            walls.append(time.perf_counter() - t0)
    finally:
        engine.shutdown(drain_timeout=0)
    return timings, walls, list(steps), engine.stats()


def make_request(req_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(
        req_id, prompt, SamplingParams(temperature=0.0), max_tokens=max_tokens, ignore_eos=True
    )


def run(
    out_dir: str | pathlib.Path | None = None,
    sizes: Sizes | None = None,
    device: str = "auto",
    dtype: str | None = None,
) -> dict[str, Any]:
    import torch

    from model.load.loader import default_model_path, load_model

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    sizes = sizes or (CPU if device == "cpu" else FULL)
    levels, prompt_len, output_len = sizes.levels, sizes.prompt_len, sizes.output_len
    system_len, num_shared = sizes.system_len, sizes.num_shared
    shared_output_len = sizes.shared_output_len
    loaded = load_model(default_model_path(), dtype=dtype, device=device)
    vocab = loaded.tokenizer.vocab_size
    rng = random.Random(0)
    n_seq_max = max(max(levels), num_shared) + 8
    n_cells = max(
        max(levels) * (prompt_len + output_len), num_shared * (system_len + 64 + shared_output_len)
    )
    n_cells += 1024
    worker = make_worker(loaded, n_cells)
    config = EngineConfig(
        n_cells=n_cells, n_seq_max=n_seq_max, n_batch=512, n_ctx_seq=2048, max_queue=1024
    )
    serve(worker, config, [[make_request("warmup", random_prompt(rng, 32, vocab), 4)]])

    results: list[LevelResult] = []
    for level in levels:
        batch = [
            make_request(f"l{level}-{i}", random_prompt(rng, prompt_len, vocab), output_len)
            for i in range(level)
        ]
        (timings,), (wall,), steps, _ = serve(worker, config, [batch])
        tpots = [t.tpot for t in timings if t.tpot is not None]
        results.append(
            LevelResult(
                level=level,
                wall_s=wall,
                output_tok_s=sum(len(t.tokens) for t in timings) / wall,
                mean_ttft_ms=1e3 * sum(t.ttft for t in timings) / len(timings),
                mean_tpot_ms=1e3 * sum(tpots) / max(len(tpots), 1),
                sched_share=sum(s.schedule_time for s in steps) / sum(s.step_time for s in steps),
                mean_sched_ms=1e3 * sum(s.schedule_time for s in steps) / len(steps),
                num_steps=len(steps),
            )
        )
        print(format_level(results[-1]), flush=True)

    system = random_prompt(rng, system_len, vocab)
    shared: dict[str, float] = {}
    for prefix_cache in (True, False):
        cfg = EngineConfig(
            n_cells=n_cells,
            n_seq_max=n_seq_max,
            n_batch=512,
            n_ctx_seq=2048,
            max_queue=1024,
            prefix_cache=prefix_cache,
        )
        warm = [make_request("warm", system + random_prompt(rng, 32, vocab), 2)]
        batch = [
            make_request(f"s{i}", system + random_prompt(rng, 32, vocab), shared_output_len)
            for i in range(num_shared)
        ]
        (_, timings), (_, wall), _, stats = serve(worker, cfg, [warm, batch])
        key = "on" if prefix_cache else "off"
        shared[f"ttft_ms_{key}"] = 1e3 * sum(t.ttft for t in timings) / len(timings)
        shared[f"wall_s_{key}"] = wall
        shared[f"hit_tokens_{key}"] = stats.prefix_cache_hit_tokens
    shared["ttft_ratio_off_on"] = shared["ttft_ms_off"] / shared["ttft_ms_on"]

    report: dict[str, Any] = {
        "model": loaded.name,
        "device": device,
        "dtype": dtype,
        "sizes": asdict(sizes),
        "levels": [asdict(r) for r in results],
        "shared_prefix": {"system_len": system_len, "num_requests": num_shared, **shared},
        "sched_share_at_max_level": results[-1].sched_share,
    }
    if out_dir is not None:
        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "engine_bench.json").write_text(json.dumps(report, indent=2))
    return report


def format_level(r: LevelResult) -> str:
    return (
        f"| {r.level:>3} | {r.output_tok_s:8.1f} | {r.mean_ttft_ms:9.1f} | {r.mean_tpot_ms:8.1f} "
        f"| {100 * r.sched_share:5.2f}% | {r.mean_sched_ms:6.2f} | {r.num_steps:>5} "
        f"| {r.wall_s:6.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--full", action="store_true", help="the full sizes even on CPU")
    parser.add_argument("--levels", default=None, help="e.g. 1,8,32,64")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--system-len", type=int, default=None)
    parser.add_argument("--num-shared", type=int, default=None)
    args = parser.parse_args()
    on_cpu = args.device == "cpu" or (args.device == "auto" and not _has_cuda())
    sizes = FULL if args.full or not on_cpu else CPU
    sizes = Sizes(
        levels=tuple(int(x) for x in args.levels.split(",")) if args.levels else sizes.levels,
        prompt_len=args.prompt_len or sizes.prompt_len,
        output_len=args.output_len or sizes.output_len,
        system_len=args.system_len or sizes.system_len,
        num_shared=args.num_shared or sizes.num_shared,
        shared_output_len=sizes.shared_output_len,
    )
    print(f"sizes: {sizes}")
    print("| seqs | out tok/s | TTFT ms | TPOT ms | sched share | sched ms/step | steps | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    report = run(args.out, sizes, device=args.device, dtype=args.dtype)
    print(json.dumps(report["shared_prefix"], indent=2))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
