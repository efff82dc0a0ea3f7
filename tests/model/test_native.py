"""model/native: the one-call C++ decode step gives the Python layers' logits, bit for bit, on
every ISA level, for int4 weights with bfloat16 activations (oneDNN-packed bfloat16 weights on
AVX-512, plain ones below) and with float32 ones (model/kernels/int4.cpp, the AVX2 default)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model import load_model
from model.native import NativeDecoder
from model.quant import quantize
from model.worker import make_worker
from tests.model.factories import Driver, require_kernels

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
    assert worker.native is not None  # int4 and int8 qualify wherever the kernels load
    return worker


def decode(worker, prompts: list[list[int]], steps: int) -> torch.Tensor:
    """Prefill every prompt, then `steps` greedy decode steps of all of them together."""
    driver = Driver(worker, worker.storage.n_cells, seed=11)
    last = driver.step([driver.chunk(s, p) for s, p in enumerate(prompts)])
    rows = []
    for _ in range(steps):
        logits = driver.logits([driver.chunk(s, [t]) for s, t in enumerate(last)])
        rows.append(logits)
        last = logits.argmax(-1).tolist()
    return torch.stack(rows)


@pytest.mark.parametrize(
    "dtype, quant, n_seq",  # 6: past SMALL_ROWS, the dense GEMMs
    [(d, "int4", n) for d in ("bfloat16", "float32") for n in (1, 3, 6)]
    + [(d, "int8", n) for d in ("bfloat16", "float32") for n in (1, 6)],
)
def test_native_layers_equal_the_python_layers(quantized, dtype, quant, n_seq, monkeypatch):
    loaded = quantized(dtype, quant)
    prompts = [
        loaded.tokenizer.encode(f"Fact {i}: the sky is blue. " * (2 + 3 * i)) for i in range(n_seq)
    ]
    worker = native_worker(loaded)
    calls = []
    layers = NativeDecoder.layers
    monkeypatch.setattr(NativeDecoder, "layers", lambda *a: calls.append(1) or layers(*a))
    native = decode(worker, prompts, steps=6)
    assert len(calls) == 6  # every decode step took the C++ path, no prefill did
    worker.native = None  # the Python path attends with the same C++ kernel: the same ops
    python = decode(worker, prompts, steps=6)
    assert torch.equal(native, python)


def test_quantized_models_qualify_and_the_reference_mode_does_not(smollm_path, quantized):
    for dtype in ("bfloat16", "float32"):
        for quant in ("int4", "int8"):
            native = native_worker(quantized(dtype, quant)).native
            assert native is not None and native.int8 == (quant == "int8")
    dense = load_model(smollm_path, dtype="float32")
    assert make_worker(dense, n_cells=64).native is None  # the float32 reference mode


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
            worker.native.layers(x, bad, storage)
    assert torch.equal(storage.k, k) and torch.equal(storage.v, v)
