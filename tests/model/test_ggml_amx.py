"""AMX for the K-quants' prompt chunks (model/kernels/ggml_kamx.h): from 32 rows, on CPUs with
AMX-INT8 (Sapphire Rapids and later Xeons) and the AVX-512 BF16 build, one tile instruction per
sub-block sums what the VNNI tiles sum, and the rest is their arithmetic. So every row's output
is the VNNI tiles' to the bit, and a row alone (k_gemv) gives the bits it gets in a prompt chunk:
checked here with AMX switched on and off in one process (`ggml_amx`), for the file's Q4_K, Q5_K
and Q6_K, the repacked Q4_K, fused parts, MoE segments and every value at its largest. Skipped
where the CPU or the build has no AMX."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model.factories import require_kernels
from tests.model.test_ggml_blocks import TYPES, make_weights

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


@pytest.fixture(scope="module")
def amx():
    kern = require_kernels()
    if not hasattr(kern, "ggml_amx") or not kern.ggml_amx():
        pytest.skip(f"no AMX here ({kern.compiled_isa()} build on this CPU)")
    yield kern
    kern.ggml_amx(1)


def both(kern, fn, *args):
    """fn(*args) with AMX, then without: (with, without)."""
    assert kern.ggml_amx(1)
    try:
        on = fn(*args)
        assert not kern.ggml_amx(0)
        off = fn(*args)
    finally:
        kern.ggml_amx(1)
    return on, off


def test_the_switch(amx):
    assert amx.ggml_amx() and not amx.ggml_amx(0) and not amx.ggml_amx()
    assert amx.ggml_amx(1) and amx.ggml_amx(-1)


@pytest.mark.parametrize("name", K_TYPES)
@pytest.mark.parametrize("k", [256, 768, 2560])
def test_amx_gives_the_vnni_tiles_bits(amx, name, k):
    """From 32 rows (whole tiles of 16, the rest on the VNNI tile; several tiles of rows at
    k = 2560; 16-31 rows stay on the VNNI tiles), outputs a multiple of 16 and not, float32 and
    bfloat16 rows."""
    rng = np.random.default_rng(k)
    t = int(TYPES[name][0])
    for n in (48, 45):
        w = torch.from_numpy(make_weights(name, n, k, rng))
        for m in (16, 17, 31, 32, 50, 130, 520):
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            for dtype in (torch.float32, torch.bfloat16):
                on, off = both(amx, amx.ggml_linear, x.to(dtype), [w], [t], k)
                assert on.dtype == dtype and torch.equal(on, off), (n, m, dtype)


@pytest.mark.parametrize("k", [256, 1536])
def test_repacked_q4k_on_amx(amx, k):
    """The repacked groups unpacked for the tiles: the file layout's bits, with AMX and without."""
    rng = np.random.default_rng(7)
    w = torch.from_numpy(make_weights("Q4_K", 64, k, rng))
    wr, t = amx.ggml_repack(w, 12, k, False)
    for m in (16, 40, 300):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        on, off = both(amx, amx.ggml_linear, x, [wr], [t], k)
        assert torch.equal(on, off), m
        assert torch.equal(on, amx.ggml_linear(x, [w], [12], k)), m


def test_a_row_alone_equals_it_in_a_prompt_chunk(amx):
    rng = np.random.default_rng(3)
    k = 768
    for name in K_TYPES:
        t = int(TYPES[name][0])
        w = torch.from_numpy(make_weights(name, 32, k, rng))
        x = torch.from_numpy(rng.standard_normal((40, k)).astype(np.float32))
        batch = amx.ggml_linear(x, [w], [t], k)
        for i in (0, 15, 16, 33, 39):
            assert torch.equal(amx.ggml_linear(x[i : i + 1], [w], [t], k)[0], batch[i]), (name, i)


@pytest.mark.parametrize("name", K_TYPES)
def test_the_largest_sums_stay_exact_on_amx(amx, name):
    """Every value and scale at its largest, every activation at +-127 (Q6_K's int8 scales at
    127 and at -128): the tile's int32 sums and their scaling do not wrap."""
    k, n, m = 512, 32, 40
    for fill in (0x7F, 0x80) if name == "Q6_K" else (None,):
        blocks = np.full((n * k // 256, TYPES[name][2]), 0xFF, dtype=np.uint8)
        if fill is not None:
            blocks[:, 192:208] = fill
        for off in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[name]:
            blocks[:, off : off + 2] = np.array([1e-3], dtype=np.float16).view(np.uint8)
        w = torch.from_numpy(blocks.reshape(n, -1))
        signs = np.where(np.arange(m) % 3 == 0, 1.0, -1.0).astype(np.float32)
        x = torch.from_numpy(np.repeat(signs[:, None], k, axis=1))
        t = int(TYPES[name][0])
        on, off = both(amx, amx.ggml_linear, x, [w], [t], k)
        assert torch.equal(on, off)
        deq = amx.ggml_dequantize(w, t, k).double()
        ref = x.double() @ deq.T  # the activations are exactly +-1 * 127 / 127
        assert torch.allclose(on.double(), ref, rtol=1e-5, atol=1e-3)


def test_fused_parts_and_segments_on_amx(amx):
    """A fused q|k|v of Q4_K and Q6_K parts, and MoE segments of 20, 0 and 37 rows."""
    rng = np.random.default_rng(5)
    k = 512
    parts = [
        torch.from_numpy(make_weights(nm, n, k, rng))
        for nm, n in (("Q4_K", 32), ("Q6_K", 16), ("Q5_K", 20))
    ]
    types = [int(TYPES[nm][0]) for nm in ("Q4_K", "Q6_K", "Q5_K")]
    x = torch.from_numpy(rng.standard_normal((57, k)).astype(np.float32))
    on, off = both(amx, amx.ggml_linear, x, parts, types, k)
    assert torch.equal(on, off)
    experts = [torch.from_numpy(make_weights(nm, 48, k, rng)) for nm in ("Q4_K", "Q6_K", "Q5_K")]
    starts = [0, 20, 20, 57]
    on, off = both(
        amx,
        lambda: amx.ggml_linear_segments(
            x, starts, [[e] for e in experts], [[t] for t in types], k
        ),
    )
    assert torch.equal(on, off)
    for s, e in enumerate(experts):
        if starts[s + 1] > starts[s]:
            alone = amx.ggml_linear(x[starts[s] : starts[s + 1]], [e], [types[s]], k)
            assert torch.equal(on[starts[s] : starts[s + 1]], alone)


def test_a_long_chunk_over_many_outputs_in_larger_tasks(amx):
    """From 128 rows with AMX, tasks of more than 16 outputs (ggml_blocks.cpp), each passing its
    tile of rows over all its columns: every output once, the bits of 16-output tasks."""
    rng = np.random.default_rng(9)
    k, n = 512, 784  # 784 / 16 = 49 columns: the tasks' split leaves a shorter last one
    parts = [torch.from_numpy(make_weights(nm, n // 2, k, rng)) for nm in ("Q4_K", "Q6_K")]
    types = [int(TYPES[nm][0]) for nm in ("Q4_K", "Q6_K")]
    x = torch.from_numpy(rng.standard_normal((200, k)).astype(np.float32))
    on, off = both(amx, amx.ggml_linear, x, parts, types, k)
    assert torch.equal(on, off)
