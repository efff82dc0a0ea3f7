"""`python -m bench.int4_bench`: float32 rows times SmolLM2-shaped int4 layers and its int8 output
head on this process's ISA path (CELLSERVE_ISA picks one), by row count: the integer kernels
(model/kernels int4_mm for small batches, int4_gemm for large ones, int8_mm for the head; int8
activations) against a dense float32 copy (oneDNN, prepacked: what batches took before
int4_gemm, and what the head takes past 32 rows) and, for the head, fbgemm's per-row dynamic
int8 linear. The crossovers set model/layers/quant.py SMALL_ROWS_INT4 / SMALL_ROWS_F32. Interleaved,
best of `--rounds`; `--rows` picks the row counts (the layers' outputs are dropped one by one,
as a forward pass does).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from model.kernels import isa

# SmolLM2-135M: wqkv, wo, w13, w2 of one layer (out, in); 30 layers; the head 49152 x 576
LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))
N_LAYERS = 30
HEAD = (49152, 576)


def best_ms(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: round(t * 1e3, 2) for name, t in best.items()}


def run(
    rounds: int = 5, rows: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 32, 64, 512)
) -> dict[str, Any]:
    level = isa.apply_forced_isa()
    import torch

    from model.kernels import load_kernels
    from model.layers.quant import (
        QuantLinear,
        dequantize_int4,
        pack_dense,
        pack_int4,
        pack_int4_gemm,
        quantize_int4,
    )

    kernels = load_kernels()
    if kernels is None or not hasattr(kernels, "int4_gemm"):
        raise SystemExit("the C++ kernels are not built: run `cellserve build-kernels`")
    gen = torch.Generator().manual_seed(0)
    layers = []
    for n, k in LAYER * N_LAYERS:
        q, sz = quantize_int4(torch.randn(n, k, generator=gen) * 0.05)
        sz = sz.bfloat16()
        dense = pack_dense(dequantize_int4(q, sz.float()))
        layers.append((n, pack_int4(q, sz), pack_int4_gemm(q, sz), dense))
    w_head = torch.randn(*HEAD, generator=gen) * 0.05
    q8 = QuantLinear(w_head, None, "q8", torch.float32, kernels)
    fbgemm = QuantLinear(w_head, None, "fbgemm8", torch.float32)
    out: dict[str, Any] = {
        "isa": level,
        "kernels": kernels.LEVEL,
        "threads": torch.get_num_threads(),
    }
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen) for _, k in LAYER}
        xh = torch.randn(m, HEAD[1], generator=gen)

        def int4_layers(xs: dict = xs) -> None:
            for (_, k), (_, (q, sm), _, _) in zip(LAYER * N_LAYERS, layers, strict=True):
                kernels.int4_mm(xs[k], q, sm)

        def gemm_layers(xs: dict = xs) -> None:
            for (_, k), (n, _, w, _) in zip(LAYER * N_LAYERS, layers, strict=True):
                kernels.int4_gemm(xs[k], w, n)

        def dense_layers(xs: dict = xs) -> None:
            for (_, k), (_, _, _, (w, packed)) in zip(LAYER * N_LAYERS, layers, strict=True):
                if packed:
                    torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
                else:
                    torch.nn.functional.linear(xs[k], w)

        fns: dict[str, Callable[[], Any]] = {
            "layers_int4_gemm": gemm_layers,
            "layers_dense_f32": dense_layers,
        }
        if m <= 64:  # 4-bit weights read once per 4 rows: memory-bound, not for batches
            fns["layers_int4_mm"] = int4_layers
            # a prompt step computes the head for its last rows only
            fns["head_int8_mm"] = lambda xh=xh: kernels.int8_mm(xh, q8.q8, q8.q8_scale)
            fns["head_dense_f32"] = lambda xh=xh: (
                torch.ops.mkldnn._linear_pointwise(xh, q8.dense, None, "none", [], "")
                if q8.dense_packed
                else torch.nn.functional.linear(xh, q8.dense)
            )
        if m <= 4:
            fns["head_fbgemm_rows"] = lambda xh=xh: fbgemm.forward(xh)
        with torch.inference_mode():
            out[f"rows_{m}"] = best_ms(fns, rounds)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", default="1,2,4,8,12,16,32,64,512", help="comma-separated")
    args = parser.parse_args()
    rows = tuple(int(r) for r in args.rows.split(","))
    print(json.dumps(run(args.rounds, rows), indent=1))
