"""`python -m bench.ggml_bench [--threads N] [--seconds S]`: ggml_linear (model/kernels/
ggml_blocks.cpp, a GGUF's own blocks) on this process's ISA path (CELLSERVE_ISA=avx2 forces the
AVX2 build): Qwen2.5-1.5B's shapes, a 1536x1536 (q / o), an 8960x1536 (gate / up) and a
1536x8960 (down) matrix of Q4_K and of Q6_K, and SmolLM2-135M's, a 576x576 and a 1536x576 matrix
of the 32-value kinds (Q4_1: its GGUF's type; Q4_0, Q5_0, Q8_0: in Q4_K_M files), at 1, 8, 32
and 512 rows of float32 activations (--types and --rows narrow it), each on the file's layout
and, for a type this build moves at load (Q4_K: model/kernels/ggml_krepack.h), on that layout
too: the one a served model computes on (before 2026-12-07 only the file's). Per case: ms per
call (the
median of repeats), and at 1 row the bandwidth it reaches (bytes of weights read / time: a
decode step reads each weight once), at 512 rows the multiply-adds per second. Speed does not
depend on the weights' values: random bits with finite fp16 scales. These matrices stay in the
CPU's caches between calls; `--model NAME|PATH` measures a real GGUF's linears instead, one
bfloat16 row (or each of --rows) through each in decode order (every weight read from memory
once a step, as a decode step reads them): ms per step and GB/s, in all and per linear and type.
The two disagree at a few rows (2026-12-05, Zen 4: at 3-5 rows the tiles beat k_gemv on the
cached matrices and lose by ~2x on the 1.5B's linears), so choices between kernels at a few
rows are made with --model."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from model.kernels import isa

ROWS = (1, 8, 32, 512)
QWEN_SHAPES = ((1536, 1536), (8960, 1536), (1536, 8960))  # (outputs, inputs)
SMOL_SHAPES = ((576, 576), (1536, 576))
# name: id, values a block, block bytes, fp16 offsets, shapes
TYPES = {
    "Q4_K": (12, 256, 144, (0, 2), QWEN_SHAPES),
    "Q6_K": (14, 256, 210, (208,), QWEN_SHAPES),
    "Q4_1": (3, 32, 20, (0, 2), SMOL_SHAPES),
    "Q4_0": (2, 32, 18, (0,), SMOL_SHAPES),
    "Q5_0": (6, 32, 22, (0,), SMOL_SHAPES),
    "Q8_0": (8, 32, 34, (0,), SMOL_SHAPES),
}


def random_blocks(torch: Any, type_name: str, n: int, k: int) -> Any:
    """[n, row_bytes] uint8 of valid blocks: random bits, finite fp16 scales."""
    _, elems, nbytes, scales, _ = TYPES[type_name]
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (n * k // elems, nbytes), dtype=torch.uint8, generator=gen)
    for off in scales:
        d = (torch.rand(len(blocks), generator=gen) * 0.01 + 1e-3).half()
        blocks[:, off : off + 2] = d.view(torch.uint8).reshape(-1, 2)
    return blocks.reshape(n, k // elems * nbytes).contiguous()


def time_call(fn: Any, seconds: float) -> tuple[float, float]:
    """The median and the best seconds per call over repeats filling about `seconds` (at least
    3): on a shared machine the best is the kernel's own speed, the median what it got."""
    fn()  # warm: page in, thread pool up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < seconds and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def run(
    threads: int = 2,
    seconds: float = 0.4,
    types: tuple[str, ...] = tuple(TYPES),
    rows: tuple[int, ...] = ROWS,
) -> dict[str, Any]:
    level = isa.apply_forced_isa()
    import torch

    from model.kernels import load_kernels

    kern = load_kernels()
    if kern is None or not hasattr(kern, "ggml_linear"):
        raise SystemExit("the C++ kernels are not built (cellserve build-kernels)")
    torch.set_num_threads(threads)
    cases = []
    for type_name in types:
        type_id, _, _, _, shapes = TYPES[type_name]
        for n, k in shapes:
            w = random_blocks(torch, type_name, n, k)
            nbytes = w.numel()
            # the file's layout, and where this build moves the type at load (BlockLinear's
            # default: model/layers/ggml.py repack) the layout the served model computes on
            layouts = [("file", w, type_id)]
            if type_id in kern.ggml_repack_types() and n % 16 == 0:
                wr, tr = kern.ggml_repack(w, type_id, k, False)
                layouts.append(("repacked", wr, int(tr)))
            for layout, wl, tl in layouts:
                for m in rows:
                    x = torch.randn(m, k)
                    med, best = time_call(
                        lambda x=x, w=wl, t=tl, k=k: kern.ggml_linear(x, [w], [t], k), seconds
                    )
                    case: dict[str, Any] = {"type": type_name, "layout": layout}
                    case.update({"n": n, "k": k, "m": m})
                    case["ms"], case["best_ms"] = round(med * 1e3, 3), round(best * 1e3, 3)
                    if m == 1:  # bytes of weights per second (median, best)
                        case["GB_s"] = [round(nbytes / t / 1e9, 2) for t in (med, best)]
                    else:  # multiply-adds per second
                        case["GMAC_s"] = [round(m * n * k / t / 1e9, 1) for t in (med, best)]
                    cases.append(case)
    return {
        "cpu": isa.cpu_model(),
        "isa": level,
        "build": kern.LEVEL,
        "threads": threads,
        "cases": cases,
    }


def decode_order(model: str, rows: int = 1, rounds: int = 6) -> dict[str, Any]:
    """Each BlockLinear of the model's default runtime on `rows` rows (a decode step of that many
    sequences, or a speculative verification of rows - 1 drafted tokens), in the order a decode
    step calls them, `rounds` times (the first two not counted)."""
    import torch

    from bench.models import resolve_model
    from model.layers.ggml import BlockLinear
    from model.serving import open_model

    opened = open_model(resolve_model(model), "cpu")
    linears = [
        (name.rsplit(".", 1)[-1] + ":" + "+".join(w.type_name for w in m.weights), m)
        for name, m in opened.loaded.transformer.named_modules()
        if isinstance(m, BlockLinear)
    ]
    if not linears:
        raise SystemExit(f"--model {model}: its default runtime has no GGUF block linears")
    spent: dict[str, list[float]] = {}
    for r in range(rounds):
        for key, m in linears:
            x = torch.randn(rows, m.in_features, dtype=torch.bfloat16)
            t0 = time.perf_counter()
            m(x)
            dt = time.perf_counter() - t0
            if r >= 2:
                t = spent.setdefault(key, [0.0, 0.0, 0.0])
                t[0], t[1], t[2] = t[0] + dt, t[1] + m.nbytes, t[2] + 1
    n = rounds - 2
    total_s, total_b = sum(v[0] for v in spent.values()) / n, sum(v[1] for v in spent.values()) / n
    return {
        "model": str(model),
        "build": isa.describe()["active"],
        "rows": rows,
        "ms_per_step": round(total_s * 1e3, 2),
        "MB_per_step": round(total_b / 1e6, 1),
        "GB_s": round(total_b / total_s / 1e9, 1),
        "linears": {
            k: {"ms": round(v[0] / v[2] * 1e3, 3), "GB_s": round(v[1] / v[0] / 1e9, 1)}
            for k, v in sorted(spent.items())
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=0.4, help="time per case (median of repeats)")
    ap.add_argument("--types", default=",".join(TYPES), help="comma-separated: " + ", ".join(TYPES))
    default_rows = ",".join(map(str, ROWS))
    ap.add_argument("--rows", help=f"comma-separated row counts ({default_rows}; --model: 1)")
    ap.add_argument("--model", help="a packaged model or a GGUF: its linears in decode order")
    args = ap.parse_args()
    if args.model:
        import torch

        if torch.get_num_threads() != args.threads:
            torch.set_num_threads(args.threads)
        row_counts = [int(r) for r in args.rows.split(",") if r.strip()] if args.rows else [1]
        indent = None if len(row_counts) > 1 else 1
        for m in row_counts:
            print(json.dumps(decode_order(args.model, m), indent=indent))
        return
    types = tuple(t.strip() for t in args.types.split(",") if t.strip())
    for t in types:
        if t not in TYPES:
            ap.error(f"--types: {t!r} is not one of {', '.join(TYPES)}")
    rows = tuple(int(r) for r in args.rows.split(",") if r.strip()) if args.rows else ROWS
    result = run(args.threads, args.seconds, types, rows)
    print(f"{result['cpu']}, {result['build']} build, {result['threads']} threads")
    print("case                             median ms   best ms   (median, best)")
    for c in result["cases"]:
        unit, (a, b) = ("GB/s", c["GB_s"]) if "GB_s" in c else ("GMAC/s", c["GMAC_s"])
        head = f"{c['type']} {c['layout']:8s} {c['n']:5d}x{c['k']} m={c['m']:4d}"
        print(f"{head}: {c['ms']:9.3f} {c['best_ms']:9.3f}   {a:7.2f} {b:7.2f} {unit}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
