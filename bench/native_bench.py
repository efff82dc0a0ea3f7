"""`python -m bench.native_bench [--rounds N] [--model gemma3|PATH]`: the default setup's decode
tokens/s at 1 and 32 sequences on this process's ISA path (set CELLSERVE_ISA to pick one), with
and without the C++ decode path, interleaved round by round in one process so that a shared
machine's load hits both alike. The model: the embedded SmolLM2 by default, "gemma3" for
Gemma-3-270M (model/load/packaged.py: sliding-window layers on their own pool, q/k and post norms,
GeGLU), or a path.

"python": the Python layers (model/layers/decoder.py), and for float32 activations QuantLinear
rounding small batches to bfloat16 for torch's int4 kernel (no int4_mm) and torch's RMSNorm /
SiLU (no fused float32 ops): what ran before the one-call step covered float32 (q8 layers
keep int8_mm, their only kernel). "native":
model/runner/native.py's one-call step with int4_mm and the fused ops. Same weights, same worker,
same prompts (bench.model_bench's decode measurement).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

from model.kernels import isa


def run(
    rounds: int = 3, concurrency: tuple[int, ...] = (1, 32), model: str | None = None
) -> dict[str, Any]:
    level = isa.apply_forced_isa()
    import torch

    from bench.model_bench import DECODE_STEPS, PROMPT_LEN, ours_decode
    from model import default_model_path, load_model
    from model.kernels import kernel_status
    from model.layers.quant import QuantLinear, quantize
    from model.load.loader import choose_runtime
    from model.load.packaged import gemma3_270m_path
    from model.runner.worker import make_worker

    path = (
        default_model_path()
        if model is None
        else gemma3_270m_path()
        if model == "gemma3"
        else pathlib.Path(model)
    )
    auto = choose_runtime(path, "cpu")
    # --quant gguf (a GGUF from 256 MiB up) runs the file's own blocks: loaded as such, or the
    # linears would be float weights and the step the Python one
    loaded = load_model(path, dtype=auto.dtype, blocks=auto.quant == "gguf")
    quantize(loaded.transformer, auto.quant)
    per_seq = PROMPT_LEN + DECODE_STEPS + 1
    worker = make_worker(loaded, n_cells=max(concurrency) * per_seq + 1)
    native, fused = worker.paths.native, worker.paths.fused
    linears = [m for m in loaded.transformer.modules() if isinstance(m, QuantLinear)]
    kernels = [m.kernels for m in linears]

    def use(fast: bool) -> None:
        worker.paths.native = native if fast else None
        worker.paths.fused = fused if fast or auto.dtype == "bfloat16" else None
        for m, k in zip(linears, kernels, strict=True):
            m.kernels = k if fast or m.kind == "q8" else None  # q8 runs on int8_mm only

    result: dict[str, Any] = {
        "model": path.name,
        "isa": level,
        "kernels": kernel_status().level or "none",
        "dtype": auto.dtype,
        "quant": auto.quant,
        "native_step": native is not None,
        "torch_threads": torch.get_num_threads(),
        "rounds": [],
    }
    vocab = loaded.config.vocab_size
    for _ in range(rounds):
        row = {}
        for fast in (False, True):
            use(fast)
            for c in concurrency:
                name = f"{'native' if fast else 'python'}_c{c}"
                row[name] = round(ours_decode(worker, c, vocab), 1)
        result["rounds"].append(row)
    use(True)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help='"gemma3" or a model path')
    args = parser.parse_args()
    print(json.dumps(run(args.rounds, model=args.model), indent=1))
