"""`python -m bench.isa_bench`: the worker on SmolLM2 on every ISA path this CPU runs, side by
side in one run: the server's default setup for that path (model.load.loader.choose_runtime) and
the float32 reference, decode tokens/s at 1, 8 and 32 sequences and prefill tokens/s of one
256-token prompt (bench.model_bench's measurements), plus the cpuid flags it saw.

Each path runs in its own process with CELLSERVE_ISA set (model/kernels/isa.py: our kernels
and torch's libraries capped at that level before the first op), one after the other.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

from model.kernels import isa

REPO = pathlib.Path(__file__).resolve().parent.parent


TEXT = (  # tests/model/test_quant.py's text
    "The history of the Roman Empire spans many centuries. It began when Augustus became the "
    "first emperor in 27 BC and, in the West, ended in 476 AD. During this time the empire built "
    "roads, aqueducts and cities across Europe, North Africa and the Middle East."
)


def text_logits(worker: Any, ids: list[int], one_row_steps: bool) -> Any:
    """Logits at every position of `ids`: teacher-forced one row a step (the quantized
    kernels), or the whole text in one step (the dense copy)."""
    import dataclasses

    import torch

    from bench.model_bench import GREEDY, make_plan
    from scheduler.plan import SampleRow

    n = len(ids) + 1
    windows = worker.model.args.memory_spec.windows
    if one_row_steps:
        return torch.cat(
            [worker.forward(make_plan([[t]], [i], n, windows)) for i, t in enumerate(ids)]
        )
    plan = make_plan([ids], [0], n, windows)
    rows = [SampleRow(r, GREEDY, 0, 0, len(ids)) for r in range(len(ids))]
    return worker.forward(dataclasses.replace(plan, samples=rows))


def closeness(ours: Any, ref: Any) -> dict[str, float]:
    """Top-1 agreement and mean KL(ref || ours), as tests/model/test_quant.py measures them."""
    import torch

    agree = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    kl = torch.nn.functional.kl_div(
        ours.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean"
    )
    return {"top1": round(agree, 3), "kl": round(float(kl), 4)}


def measure_here() -> dict[str, Any]:
    """This process's path (CELLSERVE_ISA already applied): default and reference rates."""
    level = isa.apply_forced_isa()
    import torch

    from bench.model_bench import CONCURRENCY, DECODE_STEPS, PROMPT_LEN, ours_decode, ours_prefill
    from model import default_model_path, load_model
    from model.kernels import kernel_status
    from model.layers.quant import quantize
    from model.load.loader import choose_runtime
    from model.runner.worker import make_worker

    path = default_model_path()
    auto = choose_runtime(path, "cpu")
    rows = []
    reference = None  # the float32 reference's logits over TEXT, all rows in one step
    setups = [("reference", "float32", "none"), ("default", auto.dtype, auto.quant)]
    if auto.quant == "int4" and auto.dtype != "float32":  # the integer kernels' alternative
        setups.append(("int4_f32", "float32", "int4"))
    for name, dtype, quant in setups:
        loaded = load_model(path, dtype=dtype)
        quantize(loaded.transformer, quant)
        vocab = loaded.config.vocab_size
        worker = make_worker(loaded, n_cells=max(CONCURRENCY) * (PROMPT_LEN + DECODE_STEPS + 1))
        rates = {f"decode_c{c}": round(ours_decode(worker, c, vocab), 1) for c in CONCURRENCY}
        rates["prefill"] = round(ours_prefill(worker, vocab), 1)
        native = worker.paths.native is not None
        ids = loaded.tokenizer.encode(TEXT)
        small = make_worker(loaded, n_cells=len(ids) + 1)
        decode, prompt = (text_logits(small, ids, one) for one in (True, False))
        reference = prompt if reference is None else reference
        acc = {"decode": closeness(decode, reference), "prompt": closeness(prompt, reference)}
        rows.append(
            {"setup": name, "dtype": dtype, "quant": quant, "native_step": native, **rates, **acc}
        )
        del worker, loaded, small
    return {
        "isa": level,
        "aten": torch.backends.cpu.get_cpu_capability(),
        "kernels": kernel_status().level or "none",
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
    }


def run(out_dir: pathlib.Path | str | None = None, levels: list[str] | None = None) -> dict:
    from model import kernels

    levels = levels or kernels.levels_for_this_cpu()
    result: dict[str, Any] = {"cpu": isa.describe(), "cpu_flags": sorted(isa.cpu_flags())}
    result["paths"] = []
    for level in levels:
        env = {**os.environ, isa.ENV: level}
        proc = subprocess.run(
            [sys.executable, "-m", "bench.isa_bench", "--here"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        result["paths"].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    if out_dir is not None:
        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "isa_bench.json").write_text(json.dumps(result, indent=2))
    return result


def format_table(result: dict[str, Any]) -> str:
    cpu = result["cpu"]
    lines = [
        f"CPU {cpu['cpu']} ({cpu['machine']}, {cpu['detected']}); flags seen: "
        + " ".join(f for f in result["cpu_flags"] if f.startswith(("avx", "amx", "fma", "f16c"))),
        f"{'ISA path':<12} {'kernels':<12} {'setup':<10} {'dtype':<9} {'quant':<5} "
        f"{'c=1':>7} {'c=8':>7} {'c=32':>7} {'prefill':>8}  tok/s; vs float32: top-1 / KL "
        "(one row a step | whole text)",
    ]
    for p in result["paths"]:
        for r in p["rows"]:
            lines.append(
                f"{p['isa']:<12} {p['kernels']:<12} {r['setup']:<10} {r['dtype']:<9} "
                f"{r['quant']:<5} {r['decode_c1']:>7} {r['decode_c8']:>7} {r['decode_c32']:>7} "
                f"{r['prefill']:>8}  {r['decode']['top1']} / {r['decode']['kl']} | "
                f"{r['prompt']['top1']} / {r['prompt']['kl']}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--here", action="store_true", help="measure this process's path only")
    parser.add_argument("--level", action="append", help="an ISA path (default: all this CPU runs)")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    if args.here:
        print(json.dumps(measure_here()))
    else:
        print(format_table(run(args.out, args.level)))
