"""The C++ attention kernels over cells of every cache type (kvcache/cache_types.py): decode
and prompt attention read f16 / bf16 / f32 / q8_0 / q4_0 rows in place. Two checks each: the
same attention as a float64 reference over the rows as stored (dequantized), to the float
kernels' own tolerance; and the attention of the unquantized rows within a bound derived from
the quantization error of those rows."""

from __future__ import annotations

import pytest
import torch

from kvcache.cache_types import CACHE_TYPES, cache_type
from model.kernels import isa
from tests.model.factories import require_kernels
from tests.model.test_kernels import reference

TYPES = list(CACHE_TYPES)


@pytest.fixture(scope="module")
def kernels():
    module = require_kernels()
    if not hasattr(module, "reads_cache_types"):
        pytest.fail("a kernel build without cache types")
    return module


def own_tol(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 1e-5


def stored(name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n_kv, n_cells, hd] -> the cache rows of type `name`, and their values (float32)."""
    t = cache_type(name)
    raw = t.encode(x)
    return raw, t.decode(raw, torch.float32)


def derived_bound(q, k, v, kd, vd, scale, group) -> float:
    """|attn(q; kd, vd) - attn(q; k, v)| <= max|vd - v| + ||dp||_1 max|v|, where a score moves by
    at most eps = scale * max_h ||q_h||_1 * max|kd - k| and softmax then moves the weights by
    ||dp||_1 <= exp(2 eps) - 1."""
    eps = scale * float(q.double().abs().sum(-1).max()) * float((kd - k).abs().max())
    dv = float((vd - v).abs().max())
    return dv + (torch.tensor(2 * eps).exp().item() - 1) * float(v.abs().max())


def case(seed: int, n_kv: int = 2, n_heads: int = 14, hd: int = 64, n_cells: int = 120):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n_kv, n_cells, hd, generator=gen)
    v = torch.randn(n_kv, n_cells, hd, generator=gen)
    return gen, k, v


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_cells_of_every_type(kernels, name, model_dtype):
    gen, k, v = case(1)
    kq, kd = stored(name, k)
    vq, vd = stored("q8_0" if name == "f32" else name, v)  # and K, V of different types
    lens = torch.tensor([37, 1, 100, 12])
    cells = torch.stack([torch.randperm(120, generator=gen)[:100] for _ in lens])
    q = torch.randn(len(lens), 14, 64, generator=gen).to(model_dtype)
    scale = 0.125
    got = kernels.decode_attention(q, kq, vq, cells, lens, scale)
    assert got.dtype == model_dtype and got.shape == q.shape
    # the rows as the kernel sees them: dequantized, then in the model's dtype
    want = reference(q, kd.to(model_dtype), vd.to(model_dtype), cells, lens, scale)
    assert float((got.double() - want).abs().max()) < own_tol(model_dtype)
    exact = reference(q, k.to(model_dtype), v.to(model_dtype), cells, lens, scale)
    bound = derived_bound(q, k, v, kd, vd, scale, 7) + own_tol(model_dtype)
    assert float((got.double() - exact).abs().max()) <= bound


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_prompt_attention_reads_cells_of_every_type(kernels, name, model_dtype):
    if model_dtype == torch.bfloat16 and not kernels.has_bf16_kernels():
        pytest.skip(f"no AVX-512 BF16 at ISA level {isa.active_level()}")
    if model_dtype == torch.float32 and not kernels.has_f32_kernels():
        pytest.skip(f"no AVX2 at ISA level {isa.active_level()}")
    gen, k, v = case(2, n_cells=200)
    kq, kd = stored(name, k)
    vq, vd = stored(name, v)
    past, L = 21, 37
    cells = torch.randperm(200, generator=gen)[: past + L]
    lens = torch.arange(past + 1, past + L + 1)
    q = torch.randn(L, 14, 64, generator=gen).to(model_dtype)
    scale = 0.125
    got = kernels.prompt_attention(q, kq, vq, cells, lens, scale)
    assert got.dtype == model_dtype and got.shape == q.shape
    want = reference(q, kd.to(model_dtype), vd.to(model_dtype), cells.expand(L, -1), lens, scale)
    assert float((got.double() - want).abs().max()) < own_tol(model_dtype)
    exact = reference(q, k.to(model_dtype), v.to(model_dtype), cells.expand(L, -1), lens, scale)
    bound = derived_bound(q, k, v, kd, vd, scale, 7) + own_tol(model_dtype)
    assert float((got.double() - exact).abs().max()) <= bound


def test_rows_of_no_cache_type_are_refused(kernels):
    q = torch.randn(1, 2, 64)
    cells = torch.zeros(1, 3, dtype=torch.int64)
    lens = torch.ones(1, dtype=torch.int64)
    bad = torch.zeros(2, 8, 50, dtype=torch.uint8)  # neither 2 x 34 nor 2 x 18 bytes
    with pytest.raises(RuntimeError, match="no cache type for head_dim 64"):
        kernels.decode_attention(q, bad, bad, cells, lens, 1.0)


def test_dequant_cells_matches_the_python_decoder(kernels):
    gen, k, _ = case(3)
    cells = torch.randperm(120, generator=gen)[:50]
    for name in TYPES:
        raw, values = stored(name, k)
        got = kernels.dequant_cells(raw.contiguous(), cells, 64, torch.float32)
        assert torch.equal(got, values[:, cells]), name


@pytest.mark.parametrize("name", ["f16", "q8_0", "q4_0", "bf16"])
@pytest.mark.parametrize("hd,n_heads", [(64, 14), (128, 12)])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_coded_rows_give_the_bits_of_the_same_rows_in_the_models_dtype(
    kernels, name, hd, n_heads, model_dtype
):
    """Decode attention over coded cells (each row decoded as the kernel reads it) equals, bit for
    bit, the same kernel over those rows decoded to the model's dtype first; dequant_cells too."""
    if model_dtype == torch.bfloat16 and not kernels.has_bf16_kernels():
        pytest.skip(f"no AVX-512 BF16 at ISA level {isa.active_level()}")
    if model_dtype == torch.float32 and not kernels.has_f32_kernels():
        pytest.skip(f"no AVX2 at ISA level {isa.active_level()}")
    if name == "bf16" and model_dtype == torch.bfloat16:
        pytest.skip("bf16 cells are a bfloat16 model's own")
    gen, k, v = case(4, hd=hd, n_cells=300)
    kq, kd = stored(name, k)
    vq, vd = stored("q4_0" if name == "q8_0" else name, v)
    lens = torch.tensor([1, 2, 15, 16, 17, 255, 300])
    cells = torch.stack([torch.randperm(300, generator=gen) for _ in lens])
    q = torch.randn(len(lens), n_heads, hd, generator=gen).to(model_dtype)
    got = kernels.decode_attention(q, kq, vq, cells, lens, 0.1)
    want = kernels.decode_attention(q, kd.to(model_dtype), vd.to(model_dtype), cells, lens, 0.1)
    assert torch.equal(got, want)
    some = cells[0, :77]
    decoded = kernels.dequant_cells(kq, some, hd, model_dtype)
    assert torch.equal(decoded, kd[:, some].to(model_dtype))
