"""`python -m bench.int8_bench [--model gemma3|PATH] [--rounds N]`: int8 weights with float32
activations (the default for a Q5-Q8 GGUF on a CPU without native bfloat16, e.g. AVX2) two
ways, side by side in one process on this process's ISA path (CELLSERVE_ISA picks one):
"q8", model/layers/quant.py's default where the C++ kernels are built (int8 weights with a scale per
32, int8 activations per 32 in int8_mm: llama.cpp's Q8_0 x Q8_0), and "torch_int8" (per-channel
int8 weights through torch's _weight_int8pack_mm on bfloat16-rounded rows, what int8 took
before). For each: top-1 agreement and KL against the float32 reference on a 59-token text
(decode rows one at a time, and the whole text as one prompt), and decode tok/s at 1, 8 and 32
sequences (bench.model_bench's measurement, rounds interleaved). Default model: Gemma-3-270M,
whose Q4_K_M file is mostly 5-8-bit blocks and so served int8.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

from model.kernels import isa


def run(model: str = "gemma3", rounds: int = 2) -> dict[str, Any]:
    level = isa.apply_forced_isa()
    import torch

    import model.layers.quant as quant
    from bench.isa_bench import TEXT, closeness, text_logits
    from bench.model_bench import DECODE_STEPS, PROMPT_LEN, ours_decode
    from model import default_model_path, load_model
    from model.load.packaged import gemma3_270m_path
    from model.runner.worker import make_worker

    path = {"gemma3": gemma3_270m_path, "smollm2": default_model_path}.get(model)
    path = path() if path is not None else pathlib.Path(model)
    reference = load_model(path, dtype="float32")
    ids = reference.tokenizer.encode(TEXT)
    worker = make_worker(reference, n_cells=len(ids) + 2)
    ref = (text_logits(worker, ids, True), text_logits(worker, ids, False))
    del worker, reference
    concurrency = (1, 8, 32)
    workers = {}
    result: dict[str, Any] = {"model": path.name, "isa": level, "setups": {}, "rounds": []}
    for setup in ("q8", "torch_int8"):
        loaded = load_model(path, dtype="float32")
        # without the kernels, "int8" is torch's per-channel kind
        quant.quantize(loaded.transformer, "int8", kernels=setup == "q8")
        per_seq = PROMPT_LEN + DECODE_STEPS + 1
        worker = make_worker(loaded, n_cells=max(len(ids) + 2, max(concurrency) * per_seq + 1))
        kinds = {m.kind for m in loaded.transformer.modules() if isinstance(m, quant.QuantLinear)}
        decode, prompt = text_logits(worker, ids, True), text_logits(worker, ids, False)
        result["setups"][setup] = {
            "kinds": sorted(kinds),
            "native_step": worker.paths.native is not None,
            "decode_rows": closeness(decode, ref[0]),
            "prompt": closeness(prompt, ref[1]),
        }
        workers[setup] = (worker, loaded.config.vocab_size)
    for _ in range(rounds):
        row = {}
        for setup, (worker, vocab) in workers.items():
            for c in concurrency:
                row[f"{setup}_c{c}"] = round(ours_decode(worker, c, vocab), 1)
        result["rounds"].append(row)
    result["torch_threads"] = torch.get_num_threads()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3", help='"gemma3", "smollm2" or a path')
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(run(args.model, args.rounds), indent=1))
