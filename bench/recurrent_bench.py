"""`python -m bench.recurrent_bench`: what a recurrent model costs per decode token as its context
grows, beside an attention model; the memory each keeps per sequence; and the prefix cache's
effect on a hybrid model's time to first token.

No recurrent weights can be installed here, so the Mamba2 (Mamba2-130M's shape) and the hybrid
(a Granite 4.0-H-350M-like stack) get random weights built in memory: their cost is that of real
ones. The attention model is the packaged SmolLM2-135M. Every model runs the same dtype and
weight quantization (default: this CPU's server default, bfloat16 + int4).

Decode cost: each sequence's context is placed in the memory without being computed (decode
cost does not depend on the values the K/V cells or the state slot hold), then `decode_steps`
steps of one token per sequence are timed (median). The attention model's step grows with the
cells it reads; the Mamba2 step reads one fixed-size state.
TTFT: a system prompt is served once; then a request that shares it is timed from admission to
its first token, with the prefix cache on (the state checkpoint + the attention cells are
reused) and off (recomputed), on the real Scheduler and memory.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bench.placement import place_rows
from bench.report import write_json
from scheduler.plan import (
    SamplingParams,
    StepOutput,
)


@dataclass(slots=True)
class Sizes:
    contexts: tuple[int, ...] = (256, 1024, 4096, 8192)
    num_seqs: tuple[int, ...] = (1, 4)
    decode_steps: int = 12
    system_len: int = 2000  # the hybrid's shared prefix (TTFT)
    user_len: int = 32
    # the random models' [dim, layers, ssm heads, ssm head_dim, d_state]; the hybrid's
    # attention layers: 12 heads (4 K/V) of 64 dims, and its MLPs: dim x 8/3
    mamba: tuple[int, int, int, int, int] = (768, 24, 24, 64, 128)
    hybrid: tuple[int, int, int, int, int] = (768, 16, 48, 32, 128)
    vocab: int = 32000


@dataclass(slots=True)
class Loaded:
    """What model.runner.worker.make_worker reads of a model."""

    config: Any
    transformer: Any


def random_model(args: Any, seed: int = 0) -> Loaded:
    """Random weights for every kind model.arch lists for `args` (norms near 1, A < 0)."""
    import torch

    from model.arch.weights import layer_weights, weight_shapes
    from model.layers.decoder import Transformer

    gen = torch.Generator().manual_seed(seed)
    shapes = weight_shapes(args)
    names = ["tok_embeddings", "output", "norm"]
    names += [f"layers.{i}.{k}" for i in range(args.n_layers) for k in layer_weights(args, i)]
    weights = {}
    for name in names:
        kind = name.rsplit(".", 1)[-1]
        w = torch.randn(shapes[kind], generator=gen)
        if kind.endswith("norm"):
            w = 1.0 + 0.1 * w
        elif kind == "ssm_a":
            w = -torch.exp(0.5 * w)
        else:
            w = w * (0.5 if kind.startswith("ssm_") and w.ndim == 1 else 0.05)
        weights[name] = w
    return Loaded(args, Transformer(args, weights))


def mamba2_args(sizes: Sizes) -> Any:
    from kvcache.rope import RopeConfig
    from model.arch import ModelArgs, SSMArgs

    dim, n_layers, heads, head_dim, state = sizes.mamba
    ssm = SSMArgs(heads, head_dim, state, n_groups=1, d_conv=4)
    return ModelArgs(
        "mamba2", sizes.vocab, dim, n_layers, 0, 0, 0, 0, 1e-5, RopeConfig(10000.0, 0), 0,
        mixers=("mamba2",) * n_layers, ssm=ssm, ffn=False,
    )  # fmt: skip


def hybrid_args(sizes: Sizes) -> Any:
    """Granite 4.0-H-like: an attention layer after every 7 Mamba2 layers, NoPE, a SwiGLU MLP
    in every layer."""
    from kvcache.rope import RopeConfig
    from model.arch import ModelArgs, SSMArgs

    dim, n_layers, heads, head_dim, state = sizes.hybrid
    mixers = tuple("attn" if i % 8 == 7 else "mamba2" for i in range(n_layers))
    return ModelArgs(
        "granitemoehybrid", sizes.vocab, dim, n_layers, 12, 4, 64, dim * 8 // 3, 1e-5,
        RopeConfig(10000.0, 64), 32768, mixers=mixers,
        ssm=SSMArgs(heads, head_dim, state, n_groups=1, d_conv=4), nope=True,
        attn_scale=0.015625, embed_mult=12.0, residual_mult=0.246, logits_scaling=3.0,
    )  # fmt: skip


@dataclass(slots=True)
class DecodeResult:
    model: str
    context: int
    num_seqs: int
    decode_step_ms: float
    decode_tok_s: float
    bytes_per_seq: int  # K/V cells of the context + state slot


def bench_decode(name: str, loaded: Any, sizes: Sizes, dtype: str) -> list[DecodeResult]:
    from kvcache.make import make_memory
    from model.runner.worker import make_worker

    out = []
    for n_seqs in sizes.num_seqs:
        for ctx in sizes.contexts:
            n_cells = n_seqs * (ctx + sizes.decode_steps) + 16
            memory = make_memory(loaded.config.memory_spec, n_cells, n_seqs, 512, n_ckpt=0)
            group_cells = [memory.pools[i].cells.n_cells for i in memory.group_pools]
            worker = make_worker(loaded, n_cells, dtype, group_cells=group_cells)
            for seq in range(n_seqs):  # placed, not computed (see the module docstring)
                for p0 in range(0, ctx, 512):
                    place_rows(memory, [(seq, [5] * min(512, ctx - p0), p0)])
            times = []
            for i in range(sizes.decode_steps):
                plan = place_rows(memory, [(s, [7], ctx + i) for s in range(n_seqs)])
                t = time.perf_counter()
                worker.execute(plan)
                times.append(time.perf_counter() - t)
            step_s = float(np.median(times[1:]))  # the first step warms up
            per_seq = worker.kv_bytes_per_cell * ctx + worker.state_bytes_per_slot
            out.append(DecodeResult(name, ctx, n_seqs, 1e3 * step_s, n_seqs / step_s, per_seq))
            print(format_decode(out[-1]), flush=True)
    return out


def bench_prefix_ttft(loaded: Any, sizes: Sizes, dtype: str) -> dict[str, Any]:
    """The hybrid's time to first token of a request sharing a served system prompt, prefix
    cache on and off (engine level: the Scheduler and the worker, no HTTP)."""
    from model.runner.worker import make_worker
    from scheduler.config import EngineConfig
    from scheduler.request import Request, TokenEvent
    from scheduler.scheduler import Scheduler

    rng = np.random.default_rng(1)
    system = rng.integers(10, sizes.vocab - 10, sizes.system_len).tolist()
    users = [rng.integers(10, sizes.vocab - 10, sizes.user_len).tolist() for _ in range(2)]
    greedy = SamplingParams(temperature=0.0)
    result: dict[str, Any] = {}
    for on in (True, False):
        n_ctx = sizes.system_len + sizes.user_len + 16
        config = EngineConfig(
            n_cells=4 * n_ctx, n_seq_max=4, n_batch=512, n_ctx_seq=n_ctx, prefix_cache=on,
            memory_spec=loaded.config.memory_spec,
        )  # fmt: skip
        memory = config.make_memory()
        group_cells = [memory.pools[i].cells.n_cells for i in memory.group_pools]
        worker = make_worker(loaded, config.n_cells, dtype, group_cells=group_cells)
        sched = Scheduler(config, memory)
        ttft, cached = [], 0
        for i, user in enumerate(users):
            req = Request(f"r{i}", system + user, sampling=greedy, max_tokens=2, ignore_eos=True)
            sched.add_request(req)
            start, first = time.perf_counter(), None
            while sched.has_work:
                plan = sched.schedule()
                out = worker.execute(plan) if plan.num_tokens else StepOutput([])
                for req_id, ev in sched.update(plan, out):
                    if req_id == req.req_id and isinstance(ev, TokenEvent) and first is None:
                        first = time.perf_counter() - start
                    elif req_id == req.req_id and not isinstance(ev, TokenEvent):
                        cached = ev.num_cached_tokens
            ttft.append(first)
        result["on" if on else "off"] = {"ttft_s": ttft[1], "cached_tokens": cached}
    off, on_ = result["off"]["ttft_s"], result["on"]["ttft_s"]
    result["speedup"] = off / on_ if on_ else None
    print(
        f"hybrid TTFT, {sizes.system_len}-token shared prefix: cache on "
        f"{on_ * 1e3:.0f} ms ({result['on']['cached_tokens']} cached), off {off * 1e3:.0f} ms",
        flush=True,
    )
    return result


def run(
    out_dir: str | pathlib.Path | None = None,
    sizes: Sizes | None = None,
    dtype: str = "bfloat16",
    quant: str = "int4",
    threads: int | None = None,
) -> dict[str, Any]:
    import torch

    from model.layers.quant import quantize
    from model.load.loader import default_model_path, load_model
    from model.runner.worker import set_torch_threads

    sizes = sizes or Sizes()
    set_torch_threads(threads or os.cpu_count() or 1)
    torch_dtype = getattr(torch, dtype)
    models = {
        "mamba2": random_model(mamba2_args(sizes)),
        "smollm2-135m": load_model(default_model_path(), dtype=dtype),
    }
    decode = []
    for name, loaded in models.items():
        loaded.transformer.to(torch_dtype)
        quantize(loaded.transformer, quant)
        decode += bench_decode(name, loaded, sizes, dtype)
    hybrid = random_model(hybrid_args(sizes))
    hybrid.transformer.to(torch_dtype)
    quantize(hybrid.transformer, quant)
    report = {
        "dtype": dtype,
        "quant": quant,
        "threads": torch.get_num_threads(),
        "sizes": asdict(sizes),
        "decode": [asdict(r) for r in decode],
        "hybrid_prefix_ttft": bench_prefix_ttft(hybrid, sizes, dtype),
    }
    if out_dir is not None:
        write_json(pathlib.Path(out_dir) / "recurrent_bench.json", report)
    return report


def format_decode(r: DecodeResult) -> str:
    return (
        f"| {r.model} | {r.context:>5} | {r.num_seqs} | {r.decode_step_ms:7.1f} "
        f"| {r.decode_tok_s:7.1f} | {r.bytes_per_seq / 2**20:7.2f} |"
    )


def model_parser(doc: str | None) -> argparse.ArgumentParser:
    """The flags of the benches on these random models: --out, --dtype, --quant, --threads."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quant", default="int4")
    parser.add_argument("--threads", type=int, default=None)
    return parser


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="contexts 256 and 2048, 1 sequence")
    a = parser.parse_args()
    sizes = Sizes(contexts=(256, 2048), num_seqs=(1,), system_len=600) if a.quick else None
    print("| model | context | seqs | step ms | tok/s | MiB per seq |")
    run(a.out, sizes, a.dtype, a.quant, a.threads)


if __name__ == "__main__":
    main()
