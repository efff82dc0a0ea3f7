"""model/kernels/ggml_blocks.cpp and ggml_kquants.cpp: computing on a GGUF file's own quantized
blocks, on the build the dispatcher picks (CELLSERVE_ISA=avx2 / generic run the other levels'
code).

For every GGML type: random weights quantized to it (gguf-py's quantize where it has one, K-quant
blocks built byte-wise with finite fp16 scales, and the real tensors of the Gemma-3-270M GGUF
where its packages are installed), checked against gguf-py's own dequantize: ggml_dequantize and
ggml_get_rows exactly; ggml_linear against the same product in float64 with the activations
quantized to int8 as the kernel does (tight: per 32 for the 32-value kinds, per 256 for the
K-quants, as llama.cpp's q8_0 / q8_K), and against the float activations times the dequantized
weights (loose: the int8 rows' own error)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from tests.model.factories import require_kernels

gguf = pytest.importorskip("gguf")
GT = gguf.GGMLQuantizationType

# GGML type id -> (values per block, bytes per block), as llama.cpp stores them
TYPES = {
    "F32": (GT.F32, 1, 4),
    "F16": (GT.F16, 1, 2),
    "BF16": (GT.BF16, 1, 2),
    "Q4_0": (GT.Q4_0, 32, 18),
    "Q4_1": (GT.Q4_1, 32, 20),
    "Q5_0": (GT.Q5_0, 32, 22),
    "Q5_1": (GT.Q5_1, 32, 24),
    "Q8_0": (GT.Q8_0, 32, 34),
    "MXFP4": (GT.MXFP4, 32, 17),  # gpt-oss's experts
    "Q4_K": (GT.Q4_K, 256, 144),
    "Q5_K": (GT.Q5_K, 256, 176),
    "Q6_K": (GT.Q6_K, 256, 210),
}
FLOAT = {"F32", "F16", "BF16"}
# where each K-quant block keeps its fp16 scales (byte offsets)
K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@pytest.fixture(scope="module")
def kern():
    return require_kernels()


def make_weights(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row_bytes] uint8: n rows of k values of type `name`, as a GGUF stores them."""
    qtype, elems, nbytes = TYPES[name]
    if name in K_SCALES:  # random bits, with finite, small fp16 scales
        blocks = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
        for off in K_SCALES[name]:
            scale = rng.uniform(1e-3, 2e-2, size=len(blocks)).astype(np.float16)
            blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(n, k // elems * nbytes)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    if name == "F32":
        return w.view(np.uint8)
    if name == "F16":
        return w.astype(np.float16).view(np.uint8)
    return np.ascontiguousarray(gguf.quants.quantize(w, qtype))


def dequantize(name: str, w: np.ndarray, k: int) -> np.ndarray:
    """gguf-py's dequantization: the independent reference of the block formats."""
    out = gguf.quants.dequantize(w, TYPES[name][0])
    return np.asarray(out, dtype=np.float32).reshape(w.shape[0], k)


def quantize_rows(x: np.ndarray, group: int = 32) -> np.ndarray:
    """x [m, k] float32 as the kernel's int8 rows see it: per `group` values, d = max|x| / 127,
    q = rint(x * (127 / max|x|)) (float32 arithmetic), returned as d * q in float64."""
    g = x.reshape(x.shape[0], -1, group)
    amax = np.abs(g).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(g * inv)
    d = (amax / np.float32(127)).astype(np.float32)
    return (d.astype(np.float64) * q).reshape(x.shape)


def check_linear(kern, x: torch.Tensor, parts, names, k: int) -> None:
    weights = np.concatenate(
        [dequantize(nm, w, k) for nm, w in zip(names, parts, strict=True)]
    ).astype(np.float64)
    xf = x.float().numpy()
    # per output column: the float kinds see the float rows, the others the int8 ones
    is_float = np.concatenate(
        [np.full(len(w), nm in FLOAT) for nm, w in zip(names, parts, strict=True)]
    )
    is_k = np.concatenate(
        [np.full(len(w), nm in K_SCALES) for nm, w in zip(names, parts, strict=True)]
    )
    xq = quantize_rows(xf)
    xk = quantize_rows(xf, 256) if k % 256 == 0 else xq
    want = np.where(
        is_float, xf.astype(np.float64) @ weights.T, np.where(is_k, xk @ weights.T, xq @ weights.T)
    )
    bound = np.where(
        is_float,
        np.abs(xf) @ np.abs(weights.T),
        np.where(is_k, np.abs(xk) @ np.abs(weights.T), np.abs(xq) @ np.abs(weights.T)),
    )
    types = [int(TYPES[nm][0]) for nm in names]
    got = kern.ggml_linear(x, [torch.from_numpy(w) for w in parts], types, k)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], len(weights))
    got64 = got.double().numpy()
    # float32 accumulation: a few ulps of the sum of |terms|; bfloat16 output: its rounding
    tol = 1e-5 * bound + (np.abs(want) * 2**-8 if x.dtype == torch.bfloat16 else 0)
    assert np.all(np.abs(got64 - want) <= tol + 1e-30), float(np.max(np.abs(got64 - want) - tol))
    # against the float rows: only the int8 activations' error
    exact = xf.astype(np.float64) @ weights.T
    rel = np.linalg.norm(got64 - exact) / np.linalg.norm(exact)
    assert rel < 2e-2, rel


@pytest.mark.parametrize("name", list(TYPES))
def test_dequantize_and_get_rows_match_gguf_py(kern, name):
    rng = np.random.default_rng(1)
    k = 512
    w = make_weights(name, 37, k, rng)
    qtype = int(TYPES[name][0])
    assert kern.ggml_row_bytes(qtype, k) == w.shape[1]
    want = dequantize(name, w, k)
    got = kern.ggml_dequantize(torch.from_numpy(w), qtype, k)
    assert got.dtype == torch.float32 and got.shape == (37, k)
    assert np.array_equal(got.numpy(), want, equal_nan=True)
    ids = torch.tensor([5, 0, 36, 5, 17], dtype=torch.int64)
    rows = kern.ggml_get_rows(torch.from_numpy(w), qtype, ids, k)
    assert np.array_equal(rows.numpy(), want[ids.numpy()], equal_nan=True)


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("m", [1, 3, 8, 33, 512])
def test_linear_each_type(kern, name, m):
    rng = np.random.default_rng(m)
    # 25 blocks of 32 (an odd count: the AVX-512 path pairs them, the last goes alone); K: 2
    k = 800 if name not in K_SCALES else 512
    w = make_weights(name, 45, k, rng)  # 45 outputs: two full tasks of 16 and a tail
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    check_linear(kern, x, [w], [name], k)


@pytest.mark.parametrize("name", list(K_SCALES))
@pytest.mark.parametrize("m", [1, 6])
def test_the_largest_k_quant_sums_stay_exact(kern, name, m):
    """Every weight value and scale at its largest and every activation at +-127: the AVX2 build
    sums a K-quant's products in int16 before applying its scales (Q4_K over 32 values, Q5_K 16,
    Q6_K 8), within 2^15 of overflowing there; a wrapped sum would be off by 2^16 products."""
    k, n = 512, 20
    blocks = np.full((n * k // 256, TYPES[name][2]), 0xFF, dtype=np.uint8)
    if name == "Q6_K":
        blocks[:, 192:208] = 0x7F  # int8 scales: 127
    for off in K_SCALES[name]:
        blocks[:, off : off + 2] = np.array([1e-3], dtype=np.float16).view(np.uint8)
    w = blocks.reshape(n, -1)
    signs = np.where(np.arange(m) % 2 == 0, 1.0, -1.0).astype(np.float32)
    x = torch.from_numpy(np.repeat(signs[:, None], k, axis=1))
    check_linear(kern, x, [w], [name], k)
    if name != "Q6_K":  # the minimums at their largest too: a zero dmin leaves the sums alone
        blocks[:, 2:4] = np.array([0.0], dtype=np.float16).view(np.uint8)
        check_linear(kern, x, [blocks.reshape(n, -1)], [name], k)


def test_linear_on_two_threads(kern):
    """The activation rows are quantized by an OpenMP team and read by the tasks of another:
    every kind on 2 threads (the package runs one) gives the one-thread result exactly."""
    rng = np.random.default_rng(7)
    k = 512
    names = ["Q4_K", "Q6_K", "Q5_K", "Q4_1", "Q8_0", "Q4_0", "Q5_0", "Q5_1"]
    parts = [torch.from_numpy(make_weights(nm, 40, k, rng)) for nm in names]
    types = [int(TYPES[nm][0]) for nm in names]
    x = torch.from_numpy(rng.standard_normal((300, k)).astype(np.float32))
    one = kern.ggml_linear(x, parts, types, k)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = kern.ggml_linear(x, parts, types, k)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("m", [1, 8, 33, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_mixed_parts(kern, m, dtype):
    """q|k|v or gate|up as one call with the types a Q4_K_M file mixes (and every other)."""
    rng = np.random.default_rng(100 + m)
    k = 512
    names = ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_0", "Q4_1", "Q5_1", "Q5_K", "F16", "BF16", "F32"]
    sizes = [48, 20, 17, 9, 3, 16, 5, 33, 4, 7, 2]
    parts = [make_weights(nm, n, k, rng) for nm, n in zip(names, sizes, strict=True)]
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)
    check_linear(kern, x, parts, names, k)


def test_linear_rows_and_zero_rows(kern):
    """Non-contiguous rows give the contiguous ones' result; a zero row gives zeros (its scale
    is 0, not NaN); no rows give an empty result."""
    rng = np.random.default_rng(7)
    k = 256
    w = torch.from_numpy(make_weights("Q4_K", 20, k, rng))
    t = int(GT.Q4_K)
    x = torch.from_numpy(rng.standard_normal((6, 2 * k)).astype(np.float32))[:, ::2]
    assert torch.equal(
        kern.ggml_linear(x, [w], [t], k), kern.ggml_linear(x.contiguous(), [w], [t], k)
    )
    x = x.contiguous()
    x[2] = 0
    y = kern.ggml_linear(x, [w], [t], k)
    assert torch.equal(y[2], torch.zeros(20))
    assert kern.ggml_linear(x[:0], [w], [t], k).shape == (0, 20)


def test_bad_input_is_a_clear_error(kern):
    rng = np.random.default_rng(3)
    w = torch.from_numpy(make_weights("Q8_0", 4, 64, rng))
    x = torch.zeros(2, 64)
    q8 = int(GT.Q8_0)
    with pytest.raises(ValueError, match="GGML type 99 is not supported"):
        kern.ggml_linear(x, [w], [99], 64)
    with pytest.raises(ValueError, match="bytes"):
        kern.ggml_linear(x, [w], [int(GT.Q4_0)], 64)
    with pytest.raises(ValueError, match="columns"):
        kern.ggml_linear(torch.zeros(2, 32), [w], [q8], 64)
    with pytest.raises(ValueError, match="multiple of 256"):
        kern.ggml_row_bytes(int(GT.Q4_K), 64)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kern.ggml_linear(x.double(), [w], [q8], 64)
    with pytest.raises(ValueError, match="parts"):
        kern.ggml_linear(x, [w, w], [q8], 64)
    with pytest.raises(IndexError, match="out of"):
        kern.ggml_get_rows(w, q8, torch.tensor([4]), 64)


@pytest.fixture(scope="module")
def gemma_reader():
    from model.load.packaged import GEMMA3_INSTALL, gemma3_270m_path, gemma3_installed

    if not gemma3_installed():
        reason = f"the Gemma-3-270M packages are not installed: {GEMMA3_INSTALL}"
        if os.environ.get("CELLSERVE_REQUIRE_TOOLS") == "1":
            pytest.fail(reason + " (CELLSERVE_REQUIRE_TOOLS=1)")
        pytest.skip(reason)
    return gguf.GGUFReader(gemma3_270m_path())


def test_gemma3_gguf_tensors(kern, gemma_reader):
    """The file's own tensors: layer 0's q|k|v (Q5_0, Q5_0, Q8_0), attn_output (Q4_K), ffn_down
    (Q6_K) and rows of the Q8_0 embedding."""
    tensors = {t.name: t for t in gemma_reader.tensors}

    def part(name):
        t = tensors[name]
        return t.tensor_type.name, np.array(t.data), int(t.shape[0])

    rng = np.random.default_rng(11)
    groups = [
        ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"],
        ["blk.0.attn_output.weight"],
        ["blk.0.ffn_down.weight"],
    ]
    seen = set()
    for names in groups:
        got = [part(nm) for nm in names]
        types, parts, k = [g[0] for g in got], [g[1] for g in got], got[0][2]
        seen.update(types)
        for ty, w in zip(types, parts, strict=True):
            want = dequantize(ty, w, k)
            assert np.array_equal(
                kern.ggml_dequantize(torch.from_numpy(w), int(TYPES[ty][0]), k).numpy(), want
            )
        for m in (1, 9):
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            check_linear(kern, x, parts, types, k)
    assert seen == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    ty, emb, k = part("token_embd.weight")
    ids = torch.tensor([2, 106, 262143, 2], dtype=torch.int64)
    rows = kern.ggml_get_rows(torch.from_numpy(emb), int(TYPES[ty][0]), ids, k)
    assert np.array_equal(rows.numpy(), dequantize(ty, emb[ids.numpy()], k))


def test_the_one_call_step_runs_ggml_linears(smollm_path, monkeypatch):
    """StepLinear kind "ggml" in step_layers: SmolLM2's int8 linears (q8: int8 per 32 with a
    float32 scale) handed to the step as GGUF blocks instead, each fused linear as two parts
    (its first outputs as Q8_0 blocks of the same int8 values, the rest as F32 rows of the same
    weights): the same greedy tokens and logits within the fp16 scales' rounding of the Python
    layers on the q8 weights."""
    from model import load_model
    from model.layers.quant import quantize
    from model.runner import native
    from model.runner.worker import make_worker
    from tests.model.factories import Driver

    kernels = require_kernels()
    loaded = load_model(smollm_path, dtype="float32")
    quantize(loaded.transformer, "int8")
    made = []
    step_linear = native._step_linear

    def as_ggml(kern: Any, lin: Any, dtype: torch.dtype) -> Any:
        w = step_linear(kern, lin, dtype)
        assert w.kind == "q8"
        n, k = lin.q8.shape
        scale = lin.q8_scale.half()
        blocks = torch.cat(
            [scale.view(torch.uint8).view(n, k // 32, 2), lin.q8.view(torch.uint8).view(n, -1, 32)],
            dim=2,
        ).reshape(n, k // 32 * 34)
        rows = (lin.q8.float().view(n, -1, 32) * scale.float()[..., None]).reshape(n, k)
        half = n // 2
        g = kern.StepLinear()
        g.kind = "ggml"
        g.parts = [blocks[:half].contiguous(), rows[half:].contiguous().view(torch.uint8)]
        g.types = [int(GT.Q8_0), int(GT.F32)]
        g.bias = w.bias
        made.append(g)
        return g

    monkeypatch.setattr(native, "_step_linear", as_ggml)
    worker = make_worker(loaded, n_cells=512)
    assert worker.paths.native is not None and made and kernels is not None
    calls = []
    layers = native.NativeDecoder.layers
    monkeypatch.setattr(native.NativeDecoder, "layers", lambda *a: calls.append(1) or layers(*a))
    prompts = [loaded.tokenizer.encode(t) for t in ("The sky is", "Water boils at 100 degrees")]

    def run(tokens: list[list[int]] | None) -> tuple[torch.Tensor, list[list[int]]]:
        """Prefill, then 4 decode steps of the given tokens (None: greedy)."""
        driver = Driver(worker, worker.kv[0].n_cells, seed=3)
        logits = driver.logits([driver.chunk(s, p) for s, p in enumerate(prompts)])
        out, fed = [logits], []
        for i in range(4):
            last = logits.argmax(-1).tolist() if tokens is None else tokens[i]
            fed.append(last)
            logits = driver.logits([driver.chunk(s, [t]) for s, t in enumerate(last)])
            out.append(logits)
        return torch.stack(out), fed

    ours, tokens = run(None)
    assert len(calls) >= 4  # every decode step in the one C++ call
    worker.paths.native = None
    ref, _ = run(tokens)  # the same tokens: a near-tie must not fork the two texts
    spread = float(ref.max() - ref.min())
    # per linear, fp16 scales and (for the F32 half) float rows instead of int8 ones
    assert float((ours - ref).abs().max()) < 5e-2 * spread
    assert float((ours.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.8


QUANT_TYPES = [nm for nm in TYPES if nm not in FLOAT]


@pytest.mark.parametrize("name", QUANT_TYPES)
def test_a_row_alone_equals_it_in_a_batch(kern, name):
    """A decode step's few rows take their own kernel (k_gemv for Q4_K / Q6_K on AVX-512 VNNI
    and AVX2, q_gemv for the 32-value kinds on AVX2 and AVX-512; up to 5 rows, 4 at a time):
    the same sums in the same order as the tiles, so the same y to the bit."""
    check_row_alone_equals_it_in_a_batch(kern, name)


def check_row_alone_equals_it_in_a_batch(kern: Any, name: str) -> None:
    """Each of 11 rows alone gives the bits it gets in batches of 11 (the tiles), 5 and 3
    (k_gemv's 4 + 1 and 3 rows at a time; the portable build too: test_kernels.py's generic
    build, where -ffast-math once summed a tile's rows vectorized across rows and a lone row
    another way)."""
    rng = np.random.default_rng(11)
    k = 768 if name in K_SCALES else 800
    w = torch.from_numpy(make_weights(name, 45, k, rng))
    t = int(TYPES[name][0])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.from_numpy(rng.standard_normal((11, k)).astype(np.float32)).to(dtype)
        alone = [kern.ggml_linear(x[i : i + 1], [w], [t], k)[0] for i in range(11)]
        for m in (11, 5, 3):
            batch = kern.ggml_linear(x[:m], [w], [t], k)
            for i in range(m):
                assert torch.equal(alone[i], batch[i]), (m, i)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_0", "Q8_0", "MXFP4", "F16"])
def test_segments_equal_each_ggml_linear_alone(kern, name):
    """ggml_linear_segments (a MoE layer's experts in one call): each segment of rows times its
    own weights gives the bits a ggml_linear of those rows alone gives, at 1, 2, 7 and 0 rows a
    segment (k_gemv's and the tiles' row counts), bfloat16 and float32 rows; segments that do
    not cover the rows, or differ in outputs, are refused."""
    rng = np.random.default_rng(5)
    k = 512
    t = int(TYPES[name][0])
    weights = [torch.from_numpy(make_weights(name, 48, k, rng)) for _ in range(4)]
    sizes = [1, 2, 0, 7]
    starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.from_numpy(rng.standard_normal((starts[-1], k)).astype(np.float32)).to(dtype)
        got = kern.ggml_linear_segments(x, starts, [[w] for w in weights], [[t]] * 4, k)
        assert got.shape == (starts[-1], 48) and got.dtype == dtype
        for s, w in enumerate(weights):
            rows = x[starts[s] : starts[s + 1]]
            if len(rows):
                alone = kern.ggml_linear(rows, [w], [t], k)
                assert torch.equal(got[starts[s] : starts[s + 1]], alone)
    x = torch.zeros(3, k)
    with pytest.raises(ValueError, match="cover the rows"):
        kern.ggml_linear_segments(x, [0, 2], [[weights[0]]], [[t]], k)
    with pytest.raises(ValueError, match="outputs"):
        kern.ggml_linear_segments(x, [0, 1, 3], [[weights[0]], [weights[1][:16]]], [[t], [t]], k)
