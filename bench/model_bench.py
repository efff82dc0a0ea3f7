"""`python -m bench.model_bench`: the worker on SmolLM2 beside transformers, same run, greedy.

Decode tokens/s at 1, 8 and 32 concurrent sequences (each with a 64-token prompt already in
the cache) and prefill tokens/s of one 256-token prompt, in float32, bfloat16 and float32 with
`--quant` int8/int4 (model/layers/quant.py). The transformers side is `generate` (greedy,
fixed length, its own KV cache) on the same GGUF, float32 except beside bfloat16; its decode rate is
(generate N tokens - generate 1 token) / (N - 1) per sequence.
Each rate is the best of REPEATS runs. Also breaks a decode step of the fastest variant
(int4 + bfloat16) down by ablation (step_breakdown) at 1 and 32 sequences, 300 cached tokens.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from typing import Any

import numpy as np
import torch

from model import default_model_path, load_model
from model.layers.quant import quantize
from model.runner.worker import ModelWorker, make_worker
from scheduler.plan import BatchPlan, SampleRow, SamplingParams, SeqBatch, full_group

PROMPT_LEN = 64
PREFILL_LEN = 256
DECODE_STEPS = 12
CONCURRENCY = (1, 8, 32)
REPEATS = 2  # best of: the CI machine is shared
GREEDY = SamplingParams(temperature=0.0)


def make_plan(
    tokens: list[list[int]],
    starts: list[int],
    n_cells_per_seq: int,
    windows: tuple[int, ...] = (0,),
) -> BatchPlan:
    """Seq i writes tokens[i] at positions starts[i].. into its own cell range; one plan group
    per window of the model's layer groups (each pool with the same cells)."""
    flat, pos, seqs, cells, batches, samples, kvs = [], [], [], [], [], [], []
    for i, toks in enumerate(tokens):
        row0, base = len(flat), i * n_cells_per_seq
        p = list(range(starts[i], starts[i] + len(toks)))
        flat += toks
        pos += p
        seqs += [i] * len(toks)
        cells += [base + q for q in p]
        kv = np.arange(starts[i] + len(toks))
        batches.append(SeqBatch(i, row0, len(flat)))
        kvs.append((base + kv, kv))
        samples.append(SampleRow(len(flat) - 1, GREEDY, 0, 0, len(toks)))
    tok, p_arr, seq_arr, cell_arr = (np.array(a, np.int64) for a in (flat, pos, seqs, cells))
    q_pos = [p_arr[b.start : b.end] for b in batches]
    groups = [full_group(cell_arr, kvs, q_pos, window=w) for w in windows]
    return BatchPlan(tok, p_arr, seq_arr, batches, groups, samples)


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(n)
    return rng.integers(100, vocab - 100, size=(n, length)).tolist()


def ours_decode(worker: ModelWorker, conc: int, vocab: int) -> float:
    per_seq = PROMPT_LEN + DECODE_STEPS + 1
    batch = prompts(conc, PROMPT_LEN, vocab)
    windows = worker.model.args.memory_spec.windows
    first = worker.execute(make_plan(batch, [0] * conc, per_seq, windows)).token_ids
    best = float("inf")
    for _ in range(REPEATS):
        last = first
        start = time.perf_counter()
        for step in range(DECODE_STEPS):
            plan = make_plan([[t] for t in last], [PROMPT_LEN + step] * conc, per_seq, windows)
            last = worker.execute(plan).token_ids
        best = min(best, time.perf_counter() - start)
    return conc * DECODE_STEPS / best


def ours_prefill(worker: ModelWorker, vocab: int) -> float:
    plan = make_plan(prompts(1, PREFILL_LEN, vocab), [0], PREFILL_LEN)
    worker.execute(plan)  # warm-up
    start = time.perf_counter()
    worker.execute(plan)
    return PREFILL_LEN / (time.perf_counter() - start)


def hf_rates(hf: Any, vocab: int) -> dict[str, float]:
    rates: dict[str, float] = {}

    def generate(ids: torch.Tensor, n: int) -> float:
        start = time.perf_counter()
        hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - start

    with torch.inference_mode():
        for conc in CONCURRENCY:
            ids = torch.tensor(prompts(conc, PROMPT_LEN, vocab))
            generate(ids, 2)  # warm-up
            t_one = min(generate(ids, 1) for _ in range(REPEATS))
            t_all = min(generate(ids, DECODE_STEPS + 1) for _ in range(REPEATS))
            rates[f"decode_c{conc}"] = conc * DECODE_STEPS / max(t_all - t_one, 1e-9)
        ids = torch.tensor(prompts(1, PREFILL_LEN, vocab))
        hf(ids)
        start = time.perf_counter()
        hf(ids)
        rates["prefill"] = PREFILL_LEN / (time.perf_counter() - start)
    return rates


def step_breakdown(worker: ModelWorker, vocab: int, conc: int, ctx: int) -> dict[str, Any]:
    """Where a decode step of `conc` sequences at `ctx` cached tokens goes, by ablation: the
    median step time of the Python layers, then again with each part replaced by zeros of its
    shape (cumulative): the layers' matmuls, the output head, attention (the C++ kernel where
    built, else K/V gathers + SDPA/bmm); what is left is RMSNorm, RoPE, cache writes,
    residuals, embedding, sampling and building the batch. Also the step through model.runner.native
    (one C++ call for the layers) when the worker has it."""
    model = worker.model
    per_seq = ctx + 96  # 78 decode steps follow the prompt
    worker.execute(make_plan(prompts(conc, ctx, vocab), [0] * conc, per_seq))
    position = [ctx]

    def median_ms(n: int = 15) -> float:
        times = []
        for _ in range(n):
            plan = make_plan([[123]] * conc, position * conc, per_seq)
            start = time.perf_counter()
            worker.execute(plan)
            times.append(time.perf_counter() - start)
            position[0] += 1
        return float(np.median(times)) * 1e3

    def zeros_linear(lin: torch.nn.Module, n_out: int) -> None:
        lin.forward = lambda x: x.new_zeros(x.shape[0], n_out)  # type: ignore[method-assign]

    median_ms(3)  # warm-up
    native, worker.paths.native = (
        worker.paths.native,
        None,
    )  # the ablation patches the Python layers
    native_ms = None
    if native is not None:
        worker.paths.native = native
        native_ms = median_ms()
        worker.paths.native = None
    stages = [("full step", median_ms())]
    patched: list[torch.nn.Module] = []
    for block in model.layers:
        a, f = block.mixer, block.feed_forward
        for lin, n_out in (
            (a.wqkv, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim),
            (a.wo, model.args.dim),
            (f.w13, 2 * model.args.hidden_dim),
            (f.w2, model.args.dim),
        ):
            zeros_linear(lin, n_out)
            patched.append(lin)
    stages.append(("without the layers' matmuls", median_ms()))
    zeros_linear(model.output, model.args.vocab_size)
    patched.append(model.output)
    stages.append(("and without the output head", median_ms()))
    for block in model.layers:
        a = block.mixer
        h, hd = a.n_heads, a.head_dim
        a._decode = lambda q, *_, h=h, hd=hd: q.new_zeros(q.shape[0], h, hd)
        a._prompt = lambda q, *_, h=h, hd=hd: q.new_zeros(q.shape[0], h, hd)
    stages.append(("and without attention", median_ms()))
    for m in patched:
        del m.forward
    for block in model.layers:
        del block.mixer._decode, block.mixer._prompt
    worker.paths.native = native
    parts = {
        "matmuls (30 layers)": stages[0][1] - stages[1][1],
        "output head": stages[1][1] - stages[2][1],
        "attention (C++ kernel, or K/V gathers + SDPA/bmm)": stages[2][1] - stages[3][1],
        "the rest (norms, RoPE, cache writes, sampling, batch building)": stages[3][1],
    }
    return {
        "concurrency": conc,
        "context": ctx,
        "step_ms": round(stages[0][1], 2),
        "native_step_ms": None if native_ms is None else round(native_ms, 2),
        "parts_ms": {k: round(v, 2) for k, v in parts.items()},
    }


def load_hf(path: pathlib.Path) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


VARIANTS = (
    ("float32", "none"),
    ("bfloat16", "none"),
    ("float32", "int8"),
    ("float32", "int4"),
    ("bfloat16", "int4"),
)
BREAKDOWN = ("bfloat16", "int4")  # the variant whose decode step is broken down


def run(
    out_dir: pathlib.Path | str | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """threads: torch threads (None: every core). Run it on an otherwise idle machine: an
    OpenMP team whose thread is descheduled stalls at every op and the ratios turn to noise."""
    if threads is not None:
        torch.set_num_threads(threads)
    path = default_model_path()
    hf32 = load_hf(path)
    result: dict[str, Any] = {
        "model": path.name,
        "torch_threads": torch.get_num_threads(),
        "decode_steps": DECODE_STEPS,
        "prompt_len": PROMPT_LEN,
        "rows": [],
    }
    hf_by_dtype: dict[str, dict[str, float]] = {}
    result["breakdowns"] = []
    for dtype, quant in VARIANTS:
        loaded = load_model(path, dtype=dtype)
        quantize(loaded.transformer, quant)
        vocab = loaded.config.vocab_size
        worker = make_worker(loaded, n_cells=max(CONCURRENCY) * (PROMPT_LEN + DECODE_STEPS + 1))
        ours = {f"decode_c{c}": ours_decode(worker, c, vocab) for c in CONCURRENCY}
        ours["prefill"] = ours_prefill(worker, vocab)
        if (dtype, quant) == BREAKDOWN:
            for conc in (1, max(CONCURRENCY)):
                big = make_worker(loaded, n_cells=conc * (300 + 96))
                result["breakdowns"].append(step_breakdown(big, vocab, conc, 300))
                del big
        if dtype not in hf_by_dtype:
            hf = hf32 if dtype == "float32" else hf32.to(torch.bfloat16)
            hf_by_dtype[dtype] = hf_rates(hf, vocab)
        theirs = hf_by_dtype[dtype]
        for key, value in ours.items():
            result["rows"].append(
                {
                    "dtype": dtype,
                    "quant": quant,
                    "metric": key,
                    "cellserve_tok_s": round(value, 1),
                    "transformers_tok_s": round(theirs[key], 1),
                    "ratio": round(value / theirs[key], 2),
                }
            )
        del worker, loaded
    if out_dir is not None:
        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "model_bench.json").write_text(json.dumps(result, indent=2))
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']}, torch threads {result['torch_threads']}",
        f"{'dtype':<9} {'quant':<5} {'metric':<11} {'cellserve tok/s':>16} "
        f"{'transformers tok/s':>19} {'ratio':>6}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['dtype']:<9} {r['quant']:<5} {r['metric']:<11} {r['cellserve_tok_s']:>16} "
            f"{r['transformers_tok_s']:>19} {r['ratio']:>6}"
        )
    for b in result["breakdowns"]:
        lines.append(
            f"decode step, {' + '.join(BREAKDOWN)}, {b['concurrency']} seqs x {b['context']} "
            f"cached tokens: {b['step_ms']} ms "
            f"(through model.runner.native: {b['native_step_ms']} ms)"
        )
        for part, ms in b["parts_ms"].items():
            lines.append(f"  {part:<66} {ms:>7.2f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    print(format_table(run(args.out, threads=args.threads or None)))
