"""kvcache/cache_types.py and KVStorage over every cache type: ggml's own q8_0 / q4_0 bytes,
error bounds that follow from the block formats, and the storage's writes, gathers, cell
copies (seq_cp's copy-on-write), K-shift re-rotation and raw cell access on quantized rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache.cache_types import CACHE_TYPES, QK, cache_type
from kvcache.cells import PendingOps
from kvcache.rope import RopeConfig, apply_rope
from kvcache.storage import KVStorage

TYPES = list(CACHE_TYPES)
QUANTIZED = ["q8_0", "q4_0"]


def make_storage(type_k: str, type_v: str | None = None, n_cells: int = 40, hd: int = 64):
    """Rows stored as written (no rotation: kvcache/rotation.py has its own tests)."""
    rope = RopeConfig(theta=10000.0, dim=hd, layout="neox")
    types = dict(type_k=type_k, type_v=type_v or type_k)
    return KVStorage(3, n_cells, 2, hd, torch.float32, rope=rope, rotate=False, **types)


def rows(n: int, hd: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 2, hd, generator=torch.Generator().manual_seed(seed)) * 2.0


def max_error(name: str, x: torch.Tensor) -> torch.Tensor:
    """The largest error each block of x may get from `name`, from the format alone:
    q8_0 steps of d = amax / 127 (half a step) and d rounded to fp16 (2^-11 relative, times
    |q| <= 127); q4_0 steps of d = amax / 8, a full step at the clamped top (q = 16 -> 15);
    floats: half an ulp of their mantissa."""
    amax = x.reshape(*x.shape[:-1], -1, QK).abs().amax(-1, keepdim=True)
    if name == "q8_0":
        bound = amax / 254 + amax * 2.0**-11
    elif name == "q4_0":
        bound = amax / 8 + amax * 2.0**-11
    else:
        ulp = {"f32": 2.0**-24, "f16": 2.0**-11, "bf16": 2.0**-8}[name]
        return x.abs() * ulp * 1.0001
    return bound.expand(*bound.shape[:-1], QK).reshape(x.shape) * 1.0001


@pytest.mark.parametrize("name", TYPES)
def test_round_trip_stays_within_the_formats_error(name):
    t = cache_type(name)
    x = rows(20)
    x[0, 0, :QK] = 0.0  # an all-zero block: scale 0, values 0
    back = t.decode(t.encode(x), torch.float32)
    assert back.shape == x.shape
    assert bool(((back - x).abs() <= max_error(name, x)).all())
    assert bool((back[0, 0, :QK] == 0).all())
    if name in QUANTIZED:  # and the bound is not vacuous: the error is of its order
        assert float((back - x).abs().max()) > float(max_error(name, x).max()) / 20


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_rows_are_ggmls_own_bytes(name):
    """The same bytes as the gguf package's reference quantizer (ggml's quantize_row_*_ref),
    ties and the first-largest element included."""
    from gguf import GGMLQuantizationType, quants

    x = rows(30).reshape(60, 64)
    x[1, :QK] = torch.tensor([0.5, -0.5] * 16)  # halves: roundf rounds away from zero
    x[2, :QK] = 3.0
    x[2, 5] = -3.0  # |max| twice: the first one sets q4_0's sign
    gtype = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}[name]
    want = quants.quantize(x.numpy(), gtype)
    got = cache_type(name).encode(x)
    assert got.shape == (60, 64 // QK * cache_type(name).block_bytes)
    assert np.array_equal(got.numpy(), want)
    assert np.array_equal(
        cache_type(name).decode(got, torch.float32).numpy(), quants.dequantize(want, gtype)
    )


def test_bytes_per_cell_of_qwen25_05b_geometry():
    """24 layers, 2 kv heads of 64: q8_0 is 34/64 of f16, q4_0 18/64."""
    per_cell = {
        name: KVStorage(24, 4, 2, 64, type_k=name, type_v=name).bytes_per_cell for name in TYPES
    }
    assert per_cell == {"f32": 24576, "f16": 12288, "bf16": 12288, "q8_0": 6528, "q4_0": 3456}
    mixed = KVStorage(24, 4, 2, 64, type_k="q8_0", type_v="f16")
    assert mixed.bytes_per_cell == (6528 + 12288) // 2
    assert mixed.k.nbytes + mixed.v.nbytes == 4 * mixed.bytes_per_cell


def test_bad_names_and_head_sizes_are_clear_errors():
    with pytest.raises(ValueError, match="unknown cache type 'q5_9': one of f32, f16"):
        cache_type("q5_9")
    with pytest.raises(ValueError, match="head_dim 48 is not a multiple of 32"):
        KVStorage(1, 4, 1, 48, type_k="q8_0")
    KVStorage(1, 4, 1, 48, type_k="f16")  # float types take any head_dim


@pytest.mark.parametrize("name", TYPES)
def test_write_then_gather_reads_the_stored_values(name):
    storage = make_storage(name, "q8_0" if name == "f16" else None)
    x, y = rows(6, seed=1), rows(6, seed=2)
    cells = torch.tensor([7, 0, 33, 12, 13, 14])
    storage.write(1, cells, x, y)
    k, v = storage.gather(1, cells)
    assert k.dtype == torch.float32 and k.shape == x.shape
    assert torch.equal(k, storage.type_k.decode(storage.type_k.encode(x), torch.float32))
    assert torch.equal(v, storage.type_v.decode(storage.type_v.encode(y), torch.float32))
    # a run of cells reads through a slice: the same values
    ks, _ = storage.gather_heads(1, storage.read_index(np.array([12, 13, 14])))
    assert torch.equal(ks.transpose(0, 1), k[3:])


@pytest.mark.parametrize("name", QUANTIZED)
def test_cell_copies_copy_the_stored_bytes(name):
    """seq_cp's copy-on-write (PendingOps copies) moves quantized rows as they are."""
    storage = make_storage(name)
    storage.write(0, torch.tensor([1, 2]), rows(2, seed=3), rows(2, seed=4))
    before = storage.read_cells(torch.tensor([1, 2]))
    z = np.zeros(0, np.int64)
    storage.apply(PendingOps(np.array([1, 2]), np.array([20, 21]), z, z.copy()))
    after = storage.read_cells(torch.tensor([20, 21]))
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])


@pytest.mark.parametrize("name", TYPES)
def test_k_shift_on_quantized_cells_rerotates_only_the_shifted_ones(name):
    """Dequantize, rotate by delta, quantize again: within the format's error of K rotated at
    p + delta; the unshifted cells' bytes and every V row stay as they were."""
    storage = make_storage(name)
    x = rows(8, seed=5)
    positions = [0, 5, 100, 999, 4000, 7, 30, 64]
    deltas = [3, -5, -60, -500, 1234, 0, 17, -64]
    cells = torch.tensor([9, 2, 31, 0, 17, 5, 6, 20])
    cos, sin = storage.rope.cos_sin(torch.tensor(positions))
    for layer in range(3):
        storage.write(layer, cells, apply_rope(x, cos, sin, "neox"), x)
    stored_v = storage.v.clone()
    stored_k = storage.k.clone()
    shifted = [0, 1, 2, 3, 4, 6, 7]  # cell 5 has delta 0 and is left out
    z = np.zeros(0, np.int64)
    ops = PendingOps(z, z.copy(), cells[shifted].numpy(), np.array(deltas)[shifted])
    storage.apply(ops)
    want = apply_rope(
        x, *storage.rope.cos_sin(torch.tensor(positions) + torch.tensor(deltas)), "neox"
    )
    t = storage.type_k
    for layer in range(3):
        k, _ = storage.gather(layer, cells)
        # the first storing's error, rotated (a pair (i, i + hd/2) mixes two blocks' errors:
        # at most sqrt(2) times the row's largest), plus the second storing's
        first = max_error(name, apply_rope(x, cos, sin, "neox")).amax(-1, keepdim=True)
        bound = max_error(name, want) + 2**0.5 * first
        assert bool(((k - want).abs() <= bound + 1e-5).all())
        if t.quantized:  # the stored bytes are the re-rotated values quantized once more
            assert torch.equal(
                storage.k[layer][:, cells[shifted]],
                t.encode(t.decode(storage.k[layer][:, cells[shifted]], torch.float32)),
            )
    assert torch.equal(storage.v, stored_v)
    untouched = torch.ones(storage.n_cells, dtype=torch.bool)
    untouched[cells[shifted]] = False
    assert torch.equal(storage.k[:, :, untouched], stored_k[:, :, untouched])


@pytest.mark.parametrize("name", TYPES)
def test_read_cells_and_write_cells_move_a_sequence_between_storages(name):
    """What slot save/restore does: a sequence's rows out of one cache, into other cells of
    another of the same geometry and types, read back the same."""
    a, b = make_storage(name, "q4_0"), make_storage(name, "q4_0")
    src = torch.tensor([3, 4, 5, 30])
    for layer in range(3):
        a.write(layer, src, rows(4, seed=layer), rows(4, seed=10 + layer))
    k, v = a.read_cells(src)
    assert k.shape[:3] == (3, 2, 4) and k.dtype == a.k.dtype
    dst = torch.tensor([0, 1, 2, 3])
    b.write_cells(dst, k, v)
    for layer in range(3):
        assert all(
            torch.equal(x, y)
            for x, y in zip(a.gather(layer, src), b.gather(layer, dst), strict=True)
        )
