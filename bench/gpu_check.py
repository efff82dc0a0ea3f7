"""`python -m bench.gpu_check`: the GPU check of the performance issue, as one prepared run.

On CUDA in bfloat16 (the model code is the same as on CPU; the C++ kernels are CPU-only):
1. The device's memory bandwidth, measured with large copies (read + write bytes / time).
2. Per concurrency (default 1 to 256): one decode step's time at `--ctx` cached tokens per
   sequence, the bytes it must read (every weight but the embedding table, plus the K/V of
   every cached token) and that as a share of the measured bandwidth.
3. Per concurrency: the engine (no HTTP) serving that many random prompts at once
   (`--prompt-len` -> `--output-len`, ignore_eos): output tokens per second, mean TTFT.
Without CUDA it refuses unless `--device cpu` (a dry run of the same code, for the tests).
Prints a markdown table; `--out DIR` writes gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import time
from typing import Any

import torch

from bench.engine_bench import make_request, random_prompt, serve
from bench.model_bench import make_plan
from model import default_model_path, load_model
from model.load.loader import LoadedModel
from model.runner.worker import ModelWorker, make_worker
from scheduler.config import EngineConfig


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes per second of `y.copy_(x)` over `nbytes` (each copy reads and writes nbytes)."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        y.copy_(x)
    sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def weight_bytes(loaded: LoadedModel) -> int:
    """What a decode step reads of the weights: all of them but the embedding table (a step
    gathers only its rows)."""
    model = loaded.transformer
    return sum(
        t.numel() * t.element_size()
        for name, t in model.state_dict().items()
        if name != "tok_embeddings"
    )


def decode_step_ms(worker: ModelWorker, conc: int, ctx: int, steps: int) -> float:
    """Median time of an all-decode step of `conc` sequences with `ctx` cached cells each (the
    cells' contents do not change the work, so no prefill runs first)."""
    per_seq = ctx + steps + 2
    times = []
    for i in range(steps + 2):
        plan = make_plan([[123]] * conc, [ctx + i] * conc, per_seq)
        sync(worker.device)
        start = time.perf_counter()
        worker.execute(plan)
        sync(worker.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def engine_level(
    loaded: LoadedModel, conc: int, prompt_len: int, output_len: int, n_batch: int
) -> dict[str, float]:
    n_cells = conc * (prompt_len + output_len) + 64
    worker = make_worker(loaded, n_cells)
    config = EngineConfig(
        n_cells=n_cells,
        n_seq_max=conc,
        n_batch=n_batch,
        n_ctx_seq=prompt_len + output_len,
        max_queue=1024,
    )
    rng = random.Random(conc)
    vocab = loaded.tokenizer.vocab_size
    batch = [
        make_request(f"g{conc}-{i}", random_prompt(rng, prompt_len, vocab), output_len)
        for i in range(conc)
    ]
    (timings,), (wall,), _, _ = serve(worker, config, [batch])
    tokens = sum(len(t.tokens) for t in timings)
    return {
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "mean_ttft_ms": 1e3 * statistics.mean(t.ttft for t in timings),
        "wall_s": wall,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; pass --device cpu for a dry run")
    loaded = load_model(args.model or default_model_path(), dtype=args.dtype, device=args.device)
    peak = copy_bandwidth(device, args.copy_mib << 20)
    weights = weight_bytes(loaded)
    levels = [int(x) for x in args.levels.split(",")]
    rows = []
    for conc in levels:
        worker = make_worker(loaded, conc * (args.ctx + args.steps + 2))
        step_ms = decode_step_ms(worker, conc, args.ctx, args.steps)
        kv = conc * (args.ctx + 1) * worker.kv_bytes_per_cell
        del worker
        achieved = (weights + kv) / (step_ms / 1e3)
        row = {
            "concurrency": conc,
            "decode_step_ms": step_ms,
            "decode_tok_s": conc / (step_ms / 1e3),
            "bytes_per_step": weights + kv,
            "bandwidth_gb_s": achieved / 1e9,
            "bandwidth_share": achieved / peak,
        }
        row.update(engine_level(loaded, conc, args.prompt_len, args.output_len, args.n_batch))
        rows.append(row)
        print(
            f"| {conc} | {step_ms:.2f} | {row['decode_tok_s']:.0f} | {achieved / 1e9:.0f} "
            f"| {100 * achieved / peak:.1f}% | {row['output_tok_s']:.0f} "
            f"| {row['mean_ttft_ms']:.0f} |",
            flush=True,
        )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "device": name,
        "dtype": str(loaded.transformer.dtype),
        "model": loaded.name,
        "copy_bandwidth_gb_s": peak / 1e9,
        "weight_bytes": weights,
        "ctx": args.ctx,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "levels": rows,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model", default=None, help="GGUF or HF folder (default: the embedded one)")
    p.add_argument("--levels", default="1,8,32,64,128,256")
    p.add_argument("--ctx", type=int, default=512, help="cached tokens per sequence (step)")
    p.add_argument("--steps", type=int, default=10, help="decode steps timed per level")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--n-batch", type=int, default=2048, help="engine token budget per step")
    p.add_argument("--copy-mib", type=int, default=1024, help="bytes per bandwidth copy")
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    print(
        "| seqs | decode step ms | decode tok/s | GB/s read | share of copy bandwidth "
        "| engine out tok/s | mean TTFT ms |"
    )
    print("|---|---|---|---|---|---|---|")
    report = run(args)
    print(f"copy bandwidth {report['copy_bandwidth_gb_s']:.0f} GB/s on {report['device']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
