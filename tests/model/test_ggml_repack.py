"""ggml_repack (model/kernels/ggml_krepack.h): a Q4_K weight's bytes moved 16 rows a group at
load on AVX-512 VNNI builds, 8 on the other AVX2 and AVX-512 builds (CELLSERVE_ISA=avx2 runs
those). The same bits as the file's layout at every row count (k_gemv's few rows, the tiles past
them, a prompt chunk), in fused parts beside other types and in MoE segments; refused where it
cannot hold; BlockLinear repacks by default, releases only a file mapping's pages, and
CELLSERVE_GGML_REPACK=0 keeps the file's layout."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.model.factories import require_kernels
from tests.model.test_ggml_blocks import make_weights

Q4_K, Q6_K = 12, 14
REPACKED = {"avx512_bf16": 1012, "avx512": 2012, "avx2": 2012}  # by the build's level


@pytest.fixture(scope="module")
def kern():
    return require_kernels()


@pytest.fixture(scope="module")
def x16(kern):
    """The kernels, where they repack Q4_K (the fixture's name: one of the two group widths)."""
    if Q4_K not in kern.ggml_repack_types():
        pytest.skip(f"this build ({kern.compiled_isa()}) keeps every type in the file's layout")
    return kern


def level(kern) -> str:
    """The build's level, from its file name (cellserve_kernels_<level>_<hash>)."""
    name = os.path.basename(kern.__file__)
    return next(lv for lv in sorted(REPACKED, key=len, reverse=True) if f"_{lv}_" in name)


def test_what_a_build_repacks_is_what_it_computes_on(kern):
    """AVX-512 VNNI builds repack Q4_K; every other build repacks nothing and refuses to."""
    types = list(kern.ggml_repack_types())
    assert types in ([], [Q4_K])
    w = torch.from_numpy(make_weights("Q4_K", 16, 256, np.random.default_rng(0)))
    if not types:
        with pytest.raises(ValueError, match="repacks nothing"):
            kern.ggml_repack(w, Q4_K, 256, False)


@pytest.mark.parametrize("k", [256, 768, 2560])
def test_repacked_q4k_gives_the_files_bits_at_every_row_count(x16, k):
    rng = np.random.default_rng(k)
    w = torch.from_numpy(make_weights("Q4_K", 48, k, rng))
    wr, t = x16.ggml_repack(w, Q4_K, k, False)
    assert t == REPACKED[level(x16)] and wr.shape == w.shape and wr.dtype == torch.uint8
    assert not torch.equal(wr, w)
    assert torch.equal(wr.flatten().sort().values, w.flatten().sort().values)  # moved, not changed
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 33, 130):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        for dtype in (torch.float32, torch.bfloat16):
            want = x16.ggml_linear(x.to(dtype), [w], [Q4_K], k)
            got = x16.ggml_linear(x.to(dtype), [wr], [t], k)
            assert got.dtype == dtype and torch.equal(got, want), (m, dtype)


def test_the_largest_sums_stay_exact(x16):
    """Every value, scale and minimum at its largest, every activation at +-127."""
    k, n = 512, 32
    blocks = np.full((n * k // 256, 144), 0xFF, dtype=np.uint8)
    blocks[:, 0:2] = np.array([1e-3], dtype=np.float16).view(np.uint8)
    blocks[:, 2:4] = np.array([1e-3], dtype=np.float16).view(np.uint8)
    w = torch.from_numpy(blocks.reshape(n, -1))
    wr, t = x16.ggml_repack(w, Q4_K, k, False)
    signs = np.where(np.arange(9) % 2 == 0, 1.0, -1.0).astype(np.float32)
    x = torch.from_numpy(np.repeat(signs[:, None], k, axis=1))
    want = x16.ggml_linear(x, [w], [Q4_K], k)
    assert torch.equal(x16.ggml_linear(x, [wr], [t], k), want)
    # against float64: 8 sub-blocks of 63 * 15 * 32 * 127, less 8 of 63 * 32 * 127 (d = dmin)
    q = 127 * 32 * 63
    exact = 2 * 1e-3 * (8 * 15 * q - 8 * q) / 127 * np.float16(1e-3) / 1e-3
    assert np.allclose(want[0].numpy(), exact, rtol=1e-3)


def test_fused_parts_and_segments_with_a_repacked_part(x16):
    rng = np.random.default_rng(3)
    k = 512
    q4 = torch.from_numpy(make_weights("Q4_K", 32, k, rng))
    q6 = torch.from_numpy(make_weights("Q6_K", 20, k, rng))
    q4r, t = x16.ggml_repack(q4, Q4_K, k, False)
    x = torch.from_numpy(rng.standard_normal((11, k)).astype(np.float32))
    want = x16.ggml_linear(x, [q6, q4], [Q6_K, Q4_K], k)
    assert torch.equal(x16.ggml_linear(x, [q6, q4r], [Q6_K, t], k), want)
    starts = [0, 1, 3, 11]
    got = x16.ggml_linear_segments(x, starts, [[q4r], [q4], [q4r]], [[t], [Q4_K], [t]], k)
    for s in range(3):
        rows = x[starts[s] : starts[s + 1]]
        assert torch.equal(got[starts[s] : starts[s + 1]], x16.ggml_linear(rows, [q4], [Q4_K], k))


def test_what_cannot_be_repacked_is_refused(x16):
    rng = np.random.default_rng(4)
    q4 = torch.from_numpy(make_weights("Q4_K", 20, 256, rng))
    with pytest.raises(ValueError, match="not a multiple of (8|16)"):
        x16.ggml_repack(q4, Q4_K, 256, False)
    q6 = torch.from_numpy(make_weights("Q6_K", 16, 256, rng))
    with pytest.raises(ValueError, match="not GGML type 14"):
        x16.ggml_repack(q6, Q6_K, 256, False)
    wr, t = x16.ggml_repack(q4[:16].contiguous(), Q4_K, 256, False)
    with pytest.raises(ValueError, match="for ggml_linear only"):
        x16.ggml_get_rows(wr, t, torch.tensor([0]), 256)
    with pytest.raises(ValueError, match="for ggml_linear only"):
        x16.ggml_dequantize(wr, t, 256)


def test_block_linear_repacks_and_keeps_a_copys_bytes(x16, monkeypatch):
    """A BlockWeight that is not a view of the file (mapped=False: a copy in process memory) is
    repacked without releasing its pages: its bytes are intact afterwards. With
    CELLSERVE_GGML_REPACK=0 the file's layout is computed on; both give the same y."""
    from model.layers.ggml import BlockLinear, BlockWeight, weight_bytes

    rng = np.random.default_rng(6)
    k = 512
    data = torch.from_numpy(make_weights("Q4_K", 32, k, rng))
    before = data.clone()
    weight = BlockWeight(data, Q4_K, (32, k), "w")
    lin = BlockLinear([weight], None, kernels=x16)
    assert lin.types == [REPACKED[level(x16)]] and torch.equal(data, before)
    assert weight_bytes(lin) == (0, data.numel())
    monkeypatch.setenv("CELLSERVE_GGML_REPACK", "0")
    plain = BlockLinear([weight], None, kernels=x16)
    assert plain.types == [Q4_K] and plain.parts[0] is data
    x = torch.from_numpy(rng.standard_normal((5, k)).astype(np.float32))
    assert torch.equal(lin(x), plain(x))
    # not a multiple of 16 outputs: the file's layout
    odd = BlockWeight(data[:24], Q4_K, (24, k), "odd")
    monkeypatch.delenv("CELLSERVE_GGML_REPACK")
    assert BlockLinear([odd], None, kernels=x16).types == [Q4_K]
