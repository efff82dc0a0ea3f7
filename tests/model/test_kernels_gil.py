"""model/kernels: the compute kernels run without the GIL, so the HTTP thread streams and reads
requests while the engine thread is inside a C++ step, and calls from two threads at once (two
models' engines in router mode) each get what a call alone gets. The one-call step keeps the
GIL for decode-sized steps (at most 64 rows, bindings.cpp says why) and lets go of it above."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from kvcache.rope import RopeConfig
from model import load_model
from model.arch import ModelArgs, MoEArgs
from model.layers.quant import quantize
from model.runner.native import STEP_GIL_ROWS, step_gil_rows
from tests.model.factories import Driver, require_kernels
from tests.model.test_ggml_blocks import TYPES, make_weights
from tests.model.test_native import native_worker


@pytest.fixture(scope="module")
def kern():
    return require_kernels()


def attention_call(kern, n_seq: int):
    """decode_attention over n_seq sequences of 60k bfloat16 cells each (one 8 MB K/V read per
    sequence)."""
    gen = torch.Generator().manual_seed(0)
    n_cells, n_kv, n_heads, hd = 60_000, 2, 8, 64
    k = torch.randn(n_kv, n_cells, hd, generator=gen).bfloat16()
    v = torch.randn(n_kv, n_cells, hd, generator=gen).bfloat16()
    cells = torch.arange(n_cells).repeat(n_seq, 1)
    lens = torch.full((n_seq,), n_cells)
    q = torch.randn(n_seq, n_heads, hd, generator=gen).bfloat16()
    return lambda: kern.decode_attention(q, k, v, cells, lens, 0.125)


def linear_call(kern, n_rows: int):
    """ggml_linear of n_rows rows by a 4096 x 4096 Q4_K matrix."""
    rng = np.random.default_rng(1)
    k = 4096
    w = torch.from_numpy(make_weights("Q4_K", 4096, k, rng))
    x = torch.from_numpy(rng.standard_normal((n_rows, k)).astype(np.float32))
    return lambda: kern.ggml_linear(x, [w], [int(TYPES["Q4_K"][0])], k)


def calibrated(make, kern, at_least_s: float):
    """make(kern, size) with size doubled until one call takes at_least_s (this machine's speed
    and load decide the size, not a fixed clock)."""
    size = 1
    while True:
        call = make(kern, size)
        t0 = time.perf_counter()
        call()
        if time.perf_counter() - t0 >= at_least_s or size >= 4096:
            return call
        size *= 2


@contextmanager
def one_thread():
    """The kernel on one core, the watching loop on the other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def longest_stall(call, span: dict[str, float] | None = None) -> tuple[float, float]:
    """(the longest time this thread stood still while another was inside call(), the time
    inside). `span` (t0, t1): the part of the call to watch, when the call records it itself;
    the whole call otherwise. Had the GIL been held through it, this thread could not run at all
    until it returned: one stall as long as the span."""
    span = {} if span is None else span
    done = threading.Event()

    def worker() -> None:
        t0 = time.perf_counter()
        call()
        span.setdefault("t0", t0)
        span.setdefault("t1", time.perf_counter())
        done.set()

    ticks: list[float] = []
    thread = threading.Thread(target=worker)
    thread.start()
    while not done.is_set():
        ticks.append(time.perf_counter())
    thread.join()
    t0, t1 = span["t0"], span["t1"]
    inside = [t0] + [t for t in ticks if t0 < t < t1] + [t1]
    return max(b - a for a, b in zip(inside[:-1], inside[1:], strict=True)), t1 - t0


@pytest.mark.parametrize(
    "make", [attention_call, linear_call], ids=["decode_attention", "ggml_linear"]
)
def test_python_runs_while_a_kernel_computes(kern, make):
    with one_thread():
        longest, call_s = longest_stall(calibrated(make, kern, 0.3))
    assert longest < 0.5 * call_s, f"this thread stood still {longest:.3f} s of {call_s:.3f} s"


@pytest.fixture(scope="module")
def smollm_worker(smollm_path):
    require_kernels()
    loaded = load_model(smollm_path, dtype="bfloat16")
    quantize(loaded.transformer, "int4")
    return native_worker(loaded, n_cells=4096)


@pytest.mark.parametrize(
    "rows, gil_rows, runs_beside", [(512, None, True), (64, None, False), (64, 8, True)]
)
def test_the_one_call_step_lets_python_run_past_a_decode_steps_rows(
    smollm_worker, monkeypatch, rows, gil_rows, runs_beside
):
    """step_layers over a prompt chunk of 512 rows: the event loop's thread runs beside it; over
    64 rows (a decode step of 64 streams) it waits, as bindings.cpp decides, unless the model's
    work per row lowers the rows kept (gil_rows 8: a model 8x the 1.5B). Watched over the C++
    call alone (the Python around it lets go of the GIL in torch's ops either way)."""
    native = smollm_worker.paths.native
    assert native.gil_rows == STEP_GIL_ROWS  # SmolLM2-135M: the cap
    if gil_rows is not None:
        monkeypatch.setattr(native, "gil_rows", gil_rows)
    span: dict[str, float] = {}
    step_rows: list[int] = []

    class Timed:  # the kernels module, its step_layers timed
        def __getattr__(self, name):
            return getattr(kernels, name)

        def step_layers(self, x, *args):
            step_rows.append(x.shape[0])
            span["t0"] = time.perf_counter()
            out = kernels.step_layers(x, *args)
            span["t1"] = time.perf_counter()
            return out

    kernels = native.kernels
    monkeypatch.setattr(native, "kernels", Timed())
    driver = Driver(smollm_worker, 4096)
    tokens = [int(t) for t in torch.randint(100, 40000, (rows,))]
    with one_thread():
        longest, call_s = longest_stall(lambda: driver.logits([driver.chunk(0, tokens)]), span)
    assert step_rows == [rows]  # one C++ step took the whole chunk
    stood = f"this thread stood still {longest:.3f} s of {call_s:.3f} s"
    assert (longest < 0.5 * call_s) == runs_beside, stood


def shaped(dim: int, n_layers: int, n_heads: int, n_kv: int, hidden: int, **kw) -> ModelArgs:
    head_dim = dim // n_heads
    rope = RopeConfig(10000.0, head_dim, "neox")
    return ModelArgs(
        "llama", 1000, dim, n_layers, n_heads, n_kv, head_dim, hidden, 1e-5, rope, 4096, **kw
    )


def test_the_rows_that_keep_the_gil_follow_the_models_work():
    """The 1.5B's 64-row decode step is the measured budget; an 8B's 64-stream step would hold
    the interpreter 5x as long (seconds on 2 cores): it keeps it for 12 rows only."""
    qwen_1_5b = shaped(1536, 28, 12, 2, 8960)
    llama_8b = shaped(4096, 32, 32, 8, 14336)
    smollm_135m = shaped(576, 30, 9, 3, 1536)
    assert step_gil_rows(qwen_1_5b) == 64
    assert step_gil_rows(llama_8b) == 12
    assert step_gil_rows(smollm_135m) == 64
    # a mixture of experts counts the experts a row uses, not all of them (Qwen3-30B-A3B-like)
    moe = MoEArgs(n_experts=128, n_used=8, expert_dim=768, norm_topk_prob=True)
    a3b = shaped(2048, 48, 32, 4, 6144, moe=moe)
    # per layer 9.4M (attention) + 0.26M (router) + 8 x 4.7M (the experts a row uses): 37 rows;
    # all 128 experts would be 605M a layer, 2 rows
    assert step_gil_rows(a3b) == 37


def test_calls_from_two_threads_at_once_equal_calls_alone(kern):
    """Each thread's scratch buffers are its own: the K-quant activations (quantize_rows_k) and
    the tiles' columns of one call never mix with another's running beside it."""
    rng = np.random.default_rng(2)
    k = 1024
    names = ["Q4_K", "Q6_K", "Q8_0", "Q4_0"]
    parts = [torch.from_numpy(make_weights(nm, 64, k, rng)) for nm in names]
    types = [int(TYPES[nm][0]) for nm in names]
    xs = [torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)) for m in (1, 3, 40, 200)]
    alone = [kern.ggml_linear(x, parts, types, k) for x in xs]
    got: dict[int, list[torch.Tensor]] = {}
    start = threading.Barrier(len(xs))

    def run(i: int) -> None:
        start.wait()
        got[i] = [kern.ggml_linear(xs[i], parts, types, k) for _ in range(20)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, want in enumerate(alone):
        assert all(torch.equal(y, want) for y in got[i]), f"rows {len(xs[i])}"
