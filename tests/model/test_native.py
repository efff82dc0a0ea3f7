"""model/native: the one-call C++ step gives the Python layers' logits, bit for bit, on every ISA
level, for int4 weights with bfloat16 activations (oneDNN-packed bfloat16 weights on AVX-512,
plain ones below) and with float32 ones (model/kernels/int4.cpp and gemm.cpp, the AVX2
default), for decode steps, prompt chunks and steps that mix both; and for every architecture
model/arch/ describes with attention blocks (Qwen2's biases, Gemma 3's q/k norms, post norms,
GeGLU, sliding windows and two RoPE bases), from the same LayerDesc as the Python Block."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from model import load_model
from model.layers.quant import quantize
from model.runner.native import NativeDecoder
from model.runner.worker import make_worker
from tests.model.factories import Driver, require_kernels
from tests.tiny_models import write_tiny_gemma3, write_tiny_llama
from tests.tiny_ssm import write_tiny_granite_hybrid

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def quantized(smollm_path):
    """(dtype, quant) -> SmolLM2 loaded so, once per module."""
    models = {}

    def get(dtype: str, quant: str):
        if (dtype, quant) not in models:
            require_kernels()  # quantize() keeps int4_mm's copy only where the kernels load
            loaded = load_model(smollm_path, dtype=dtype)
            quantize(loaded.transformer, quant)
            models[dtype, quant] = loaded
        return models[dtype, quant]

    return get


def native_worker(loaded, n_cells: int = 1024):
    require_kernels()
    worker = make_worker(loaded, n_cells=n_cells)
    assert worker.paths.native is not None  # int4 and int8 qualify wherever the kernels load
    return worker


def decode(worker, prompts: list[list[int]], steps: int) -> torch.Tensor:
    """Prefill every prompt, then `steps` greedy decode steps of all of them together; the
    logits of the prefill's last rows, then of each step."""
    driver = Driver(worker, worker.kv[0].n_cells, seed=11)
    logits = driver.logits([driver.chunk(s, p) for s, p in enumerate(prompts)])
    rows = [logits]
    for _ in range(steps):
        last = logits.argmax(-1).tolist()
        logits = driver.logits([driver.chunk(s, [t]) for s, t in enumerate(last)])
        rows.append(logits)
    return torch.stack(rows)


def prompt_kernel_runs(worker) -> bool:
    """Prompts take the C++ step where the prompt kernel exists for the model's dtype."""
    return worker.paths.prompt_attention is not None


@pytest.mark.parametrize(
    "dtype, quant, n_seq",  # 6: past SMALL_ROWS, the dense GEMMs; and int4_gemm past 8 rows
    [(d, "int4", n) for d in ("bfloat16", "float32") for n in (1, 3, 6, 10)]
    + [(d, "int8", n) for d in ("bfloat16", "float32") for n in (1, 6)],
)
def test_native_layers_equal_the_python_layers(quantized, dtype, quant, n_seq, monkeypatch):
    loaded = quantized(dtype, quant)
    prompts = [
        loaded.tokenizer.encode(f"Fact {i}: the sky is blue. " * (2 + 3 * i)) for i in range(n_seq)
    ]
    worker = native_worker(loaded, n_cells=4096)
    calls = []
    layers = NativeDecoder.layers
    monkeypatch.setattr(NativeDecoder, "layers", lambda *a: calls.append(1) or layers(*a))
    native = decode(worker, prompts, steps=6)
    # every decode step took the C++ path, and the prefill too where the prompt kernel runs
    assert len(calls) == 6 + prompt_kernel_runs(worker)
    worker.paths.native = None  # the Python path calls the same C++ kernels: the same ops
    python = decode(worker, prompts, steps=6)
    assert torch.equal(native, python)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_step_mixing_prompts_and_decodes_equals_the_python_layers(quantized, dtype, monkeypatch):
    """Two sequences decode while a third's prompt arrives in two chunks: steps with decode
    groups and prompt chunks together run in one C++ call, with the Python layers' logits."""
    loaded = quantized(dtype, "int4")
    worker = native_worker(loaded)
    if not prompt_kernel_runs(worker):
        pytest.skip(f"no prompt kernel for {dtype} on this ISA path: mixed steps stay in Python")
    calls = []
    layers = NativeDecoder.layers
    monkeypatch.setattr(NativeDecoder, "layers", lambda *a: calls.append(1) or layers(*a))
    tok = loaded.tokenizer.encode
    first, late = [tok("The sky is"), tok("Water boils at")], tok("A long prompt: " * 12)

    def run() -> torch.Tensor:
        driver = Driver(worker, worker.storage.n_cells, seed=5)
        out = [driver.logits([driver.chunk(s, p) for s, p in enumerate(first)])]
        half = len(late) // 2
        for chunk in (late[:half], late[half:], None):
            last = out[-1][:2].argmax(-1).tolist()
            step = [driver.chunk(s, [t]) for s, t in enumerate(last)]
            if chunk is not None:
                step.append(driver.chunk(2, chunk))
            out.append(driver.logits(step)[:2])
        return torch.cat(out)

    native = run()
    assert len(calls) == 4  # the prefill, two mixed steps, one decode step
    worker.paths.native = None
    assert torch.equal(native, run())


def test_quantized_models_qualify_and_the_reference_mode_does_not(smollm_path, quantized):
    for dtype in ("bfloat16", "float32"):
        for quant in ("int4", "int8"):
            native = native_worker(quantized(dtype, quant)).paths.native
            assert native is not None
            # float32 rows take cellserve's integer kernels (int4_mm / int4_gemm, int8_mm's
            # Q8_0 x Q8_0), bfloat16 ones torch's
            want = {"float32": {"int4": "int4_f32", "int8": "q8"}}.get(dtype, {}).get(quant, quant)
            assert {w.kind for layer in native.layers_ for w in (layer.wqkv, layer.w2)} == {want}
    dense = load_model(smollm_path, dtype="float32")
    assert make_worker(dense, n_cells=64).paths.native is None  # the float32 reference mode


def test_a_write_cell_out_of_range_is_refused_before_any_write(quantized, monkeypatch):
    """decode_layers copies K/V rows by raw pointer: a cell past the cache is a clear error,
    and the cache is left as it was."""
    loaded = quantized("float32", "int4")
    worker = native_worker(loaded, n_cells=64)
    captured = []
    layers = NativeDecoder.layers
    monkeypatch.setattr(
        NativeDecoder, "layers", lambda s, x, b, st: captured.append((x, b)) or layers(s, x, b, st)
    )
    decode(worker, [loaded.tokenizer.encode("The sky is")], steps=1)
    x, batch = captured[0]
    storage = worker.storage
    k, v = storage.k.clone(), storage.v.clone()
    for cell in (storage.n_cells, -1):
        bad = dataclasses.replace(batch, cells=torch.full_like(batch.cells, cell))
        with pytest.raises(RuntimeError, match=r"write_cells\[0\] = .* is not in \[0, 64\)"):
            worker.paths.native.layers(x, bad, storage)
    assert torch.equal(storage.k, k) and torch.equal(storage.v, v)


# Tiny random models whose sizes the kernels take (int4 groups of 32, head_dim 32): the
# architectures beyond Llama that the C++ step follows from their description alone.
TINY = {
    "qwen2": lambda d: write_tiny_llama(d, dim=128, hidden_dim=256, model_type="qwen2"),
    "qwen3": lambda d: write_tiny_llama(
        d, dim=128, n_heads=2, hidden_dim=256, model_type="qwen3", head_dim=32
    ),
    "smollm3": lambda d: write_tiny_llama(
        d, n_layers=4, dim=128, hidden_dim=256, model_type="smollm3"
    ),
    "gemma3": lambda d: write_tiny_gemma3(
        d, dim=128, n_heads=4, n_kv_heads=1, head_dim=32, hidden_dim=256, window=8
    ),
    # Granite 4.0-H's attention blocks alone: NoPE, residual and embedding multipliers
    "granite": lambda d: write_tiny_granite_hybrid(
        d, layer_types=("attention",) * 3, dim=128, hidden_dim=256, mamba_head_dim=32
    ),
}


@pytest.fixture(scope="module")
def tiny_quantized(tmp_path_factory):
    folders, models = {}, {}

    def get(arch: str, dtype: str, quant: str):
        if arch not in folders:
            folders[arch] = TINY[arch](tmp_path_factory.mktemp(arch) / "model")
        if (arch, dtype, quant) not in models:
            require_kernels()
            loaded = load_model(folders[arch], dtype=dtype)
            quantize(loaded.transformer, quant)
            models[arch, dtype, quant] = loaded
        return models[arch, dtype, quant]

    return get


@pytest.mark.parametrize(
    "arch, dtype, quant, n_seq",  # 10 sequences: past small_rows, the dense copy / int4_gemm
    [(a, d, "int4", n) for a in TINY for d in ("bfloat16", "float32") for n in (1, 10)]
    + [(a, d, "int8", 3) for a in TINY for d in ("bfloat16", "float32")],
)
def test_other_architectures_run_their_description_natively(
    tiny_quantized, arch, dtype, quant, n_seq, monkeypatch
):
    loaded = tiny_quantized(arch, dtype, quant)
    worker = native_worker(loaded, n_cells=1024)
    desc = loaded.config.layer_desc(0)
    if arch == "gemma3":  # its windowed layers attend through their own pool and groups
        assert desc.qk_norm and desc.post_norms and desc.activation == "gelu_tanh"
        assert worker.paths.native.windows == [0, 8] and worker.paths.native.swa_rope
    elif arch == "granite":
        assert desc.rope is None and desc.residual_mult == 0.5
    elif arch == "smollm3":
        assert loaded.config.layer_desc(3).rope is None and desc.rope is not None
    elif arch == "qwen3":
        assert desc.qk_norm and not desc.qkv_bias and worker.paths.native.windows == [0]
    else:
        assert desc.qkv_bias and worker.paths.native.windows == [0]
    prompts = [[(7 * i + 13 * s) % 300 + 5 for i in range(12 + 5 * s)] for s in range(n_seq)]
    calls = []
    layers = NativeDecoder.layers
    monkeypatch.setattr(NativeDecoder, "layers", lambda *a: calls.append(1) or layers(*a))
    native = decode(worker, prompts, steps=8)  # decode rows pass the window of 8
    # Gemma's prompts (12 tokens and more) pass its window of 8: the prompt kernel reads each
    # row's window (its first cell)
    assert len(calls) == 8 + prompt_kernel_runs(worker)
    worker.paths.native = None
    python = decode(worker, prompts, steps=8)
    assert torch.equal(native, python)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_prompt_past_the_window_takes_the_one_call_step(tiny_quantized, dtype, monkeypatch):
    """Gemma 3's sliding layers (window 8): a prompt of 8 tokens sees a prefix of its cells in
    every layer; past 8 the window cuts the first cells of the later rows, and the prompt
    kernel reads each row's range (its first cell). Every prefill, in one chunk or in chunks
    that start inside the window, runs in the one-call step and equals the Python layers bit
    for bit, and the masked torch attention (no kernel) up to rounding."""
    loaded = tiny_quantized("gemma3", dtype, "int4")
    worker = native_worker(loaded, n_cells=1024)
    if not prompt_kernel_runs(worker):
        pytest.skip(f"no prompt kernel for {dtype} on this build")
    native, kernel = worker.paths.native, worker.paths.prompt_attention
    calls: list[int] = []
    layers = NativeDecoder.layers
    monkeypatch.setattr(NativeDecoder, "layers", lambda *a: calls.append(1) or layers(*a))

    def prefill(chunks: list[int]) -> torch.Tensor:
        """Three sequences, each prompt in chunks of these sizes; the last chunk's logits."""
        driver = Driver(worker, worker.kv[0].n_cells, seed=11)
        tokens = [[(7 * i + 13 * s) % 300 + 5 for i in range(sum(chunks))] for s in range(3)]
        at = 0
        for size in chunks:
            got = driver.logits([driver.chunk(s, t[at : at + size]) for s, t in enumerate(tokens)])
            at += size
        return got

    for chunks in ([8], [9], [30], [5, 21], [13, 4, 13]):
        calls.clear()
        worker.paths.native, worker.paths.prompt_attention = native, kernel
        got = prefill(chunks)
        assert len(calls) == len(chunks), chunks
        worker.paths.native = None
        assert torch.equal(got, prefill(chunks)), chunks
        worker.paths.prompt_attention = None  # the masked torch path
        masked = prefill(chunks)
        # one bfloat16 step at the logits' scale (a missed window moves them 1.2-6); float32
        # too: the int4 linears round their input rows to int8, and the masked torch path's
        # summation order (torch's own kernels, CPU-dependent) flips one such rounding now and
        # then (0.10 at a scale of 127 on an Intel Xeon, float32, chunks 13 / 4 / 13)
        scale = float(masked.float().abs().max())
        tol = 2.0 ** (math.floor(math.log2(scale)) - 7)
        assert float((got.float() - masked.float()).abs().max()) <= tol, chunks
        assert torch.equal(got.argmax(-1), masked.argmax(-1)), chunks
    worker.paths.native, worker.paths.prompt_attention = native, kernel
