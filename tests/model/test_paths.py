"""KernelPaths: what a worker's linears run, counted once when the worker is built and said in
the start-up line (model/runner/paths.py linear_paths)."""

from __future__ import annotations

import pytest

from model import load_model
from model.layers.quant import quantize
from model.runner.paths import linear_paths
from model.runner.worker import make_worker
from tests.model.factories import require_kernels
from tests.tiny_gguf import write_tiny_gguf
from tests.tiny_models import write_tiny_llama

N_LAYERS = 2
PER_LAYER = 4  # wqkv, wo, w13, w2 (fused at load)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("paths") / "tiny", n_layers=N_LAYERS)


def test_a_gguf_files_blocks_run_on_ggml_linear(folder, tmp_path):
    require_kernels()
    path = write_tiny_gguf(tmp_path / "q8.gguf", folder, qtype="Q8_0")
    loaded = load_model(path, dtype="bfloat16", blocks=True)
    worker = make_worker(loaded, n_cells=64)
    linears = worker.paths.linears
    assert sum(linears.values()) == N_LAYERS * PER_LAYER + 1, linears  # and the head
    assert all(way.startswith("C++ ggml_linear Q8_0") for way in linears), linears
    assert "linears: C++ ggml_linear Q8_0 x 9" in worker.paths.describe()
    assert not worker.paths.amx  # the 32-value kinds stay on the vector units' tiles


@pytest.mark.parametrize(
    ("dtype", "body", "head"),
    [
        ("bfloat16", "C++ quant_linear int4", "torch fbgemm8"),
        ("float32", "C++ quant_linear int4_f32", "C++ quant_linear q8"),
    ],
)
def test_int4_linears_by_dtype(folder, dtype, body, head):
    """int4 bodies run quant_linear at either dtype (int4_f32: float32 rows on int8 kernels);
    the 8-bit head is the kernels' q8 with float32 rows, fbgemm's with bfloat16 ones."""
    require_kernels()
    loaded = load_model(folder, dtype=dtype)
    quantize(loaded.transformer, "int4")
    worker = make_worker(loaded, n_cells=64)
    assert worker.paths.linears == {body: N_LAYERS * PER_LAYER, head: 1}


def test_without_quantization_every_linear_is_torch(folder):
    loaded = load_model(folder, dtype="float32")
    assert linear_paths(loaded.transformer) == {"torch": N_LAYERS * PER_LAYER + 1}
