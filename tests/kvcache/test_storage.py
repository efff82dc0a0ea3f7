"""KVStorage: writes, gathers, cell copies and the deferred K-shift (RoPE composition)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache.cells import KVCells, PendingOps
from kvcache.rope import RopeConfig, apply_rope, rope_partner, rope_tables
from kvcache.storage import KVStorage

LAYOUTS = ["interleaved", "neox"]


def make_storage(
    n_cells: int = 32, layout: str = "neox", dtype: torch.dtype = torch.float32, **rope
) -> KVStorage:
    cfg = RopeConfig(theta=rope.get("theta", 10000.0), dim=rope.get("dim", 16), layout=layout)
    cfg.freq_factors = rope.get("freq_factors")
    return KVStorage(n_layers=3, n_cells=n_cells, n_kv_heads=2, head_dim=16, dtype=dtype, rope=cfg)


def rotated(x: torch.Tensor, positions: list[int], rope: RopeConfig) -> torch.Tensor:
    cos, sin = rope.cos_sin(torch.tensor(positions))
    return apply_rope(x, cos, sin, rope.layout)


def shift_ops(cells: list[int], deltas: list[int]) -> PendingOps:
    z = np.zeros(0, np.int64)
    return PendingOps(z, z.copy(), np.array(cells, np.int64), np.array(deltas, np.int64))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "rope", [{}, {"theta": 500000.0, "freq_factors": tuple(1.0 + i for i in range(8))}]
)
def test_k_rotated_at_p_then_shifted_equals_rotated_at_p_plus_delta(layout, rope):
    storage = make_storage(layout=layout, **rope)
    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(0))
    positions = [0, 5, 100, 999, 4000, 7, 8191, 30]
    deltas = [3, -5, -60, -500, 1234, 0, -8000, 17]
    cells = torch.tensor([9, 2, 31, 0, 17, 5, 6, 20])
    for layer in range(storage.n_layers):
        storage.write(layer, cells, rotated(x, positions, storage.rope), x)
    storage.apply(shift_ops(cells.tolist(), deltas))
    want = rotated(x, [p + d for p, d in zip(positions, deltas, strict=True)], storage.rope)
    for layer in range(storage.n_layers):
        k, v = storage.gather(layer, cells)
        assert float((k - want).abs().max()) < 1e-5
        assert torch.equal(v, x)  # V is never touched by a shift
    assert float((want - rotated(x, positions, storage.rope)).abs().max()) > 0.1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_rotate_different_pairs(layout):
    rope = RopeConfig(theta=10000.0, dim=4, layout=layout)
    x = [1.0, 2.0, 3.0, 4.0]
    out = rotated(torch.tensor([[x]]), [1], rope)[0, 0].tolist()
    c, s = np.cos(1.0), np.sin(1.0)
    a, b = (0, 1) if layout == "interleaved" else (0, 2)  # the pair turning at frequency 1
    assert out[a] == pytest.approx(x[a] * c - x[b] * s, abs=1e-6)
    assert out[b] == pytest.approx(x[b] * c + x[a] * s, abs=1e-6)


def test_partial_rotary_leaves_tail_dims():
    rope = RopeConfig(theta=10000.0, dim=8, layout="neox")
    x = torch.randn(3, 2, 16)
    out = rotated(x, [1, 2, 3], rope)
    assert torch.equal(out[..., 8:], x[..., 8:]) and not torch.equal(out[..., :8], x[..., :8])


def test_bfloat16_storage_shift_is_computed_in_float32():
    storage = make_storage(dtype=torch.bfloat16)
    x = torch.randn(4, 2, 16)
    cells = torch.tensor([0, 1, 2, 3])
    storage.write(0, cells, rotated(x, [10, 20, 30, 40], storage.rope), x)
    storage.apply(shift_ops([0, 1, 2, 3], [-10, -10, -10, -10]))
    want = rotated(x, [0, 10, 20, 30], storage.rope)
    k, _ = storage.gather(0, cells)
    assert k.dtype == torch.bfloat16
    assert float((k.float() - want).abs().max()) < 0.05


def test_copies_run_in_order_before_shifts():
    storage = make_storage()
    for c in range(4):
        storage.k[:, :, c] = float(c)
        storage.v[:, :, c] = float(c) + 0.5
    ops = PendingOps(
        copy_src=np.array([0, 5], np.int64),
        copy_dst=np.array([5, 6], np.int64),  # 6 gets what 0 had, through 5
        shift_cells=np.array([6], np.int64),
        shift_deltas=np.array([0], np.int64),
    )
    storage.apply(ops)
    assert torch.equal(storage.k[:, :, 6], storage.k[:, :, 0]) and torch.equal(
        storage.v[:, :, 6], storage.v[:, :, 0]
    )
    assert float(storage.v[2, 0, 6, 0]) == 0.5


def test_shifting_one_of_two_sharing_seqs_leaves_the_other_bit_identical():
    n_cells = 32
    cells = KVCells(n_cells=n_cells, n_seq_max=2)
    storage = make_storage(n_cells=n_cells)
    x = torch.randn(10, 2, 16, generator=torch.Generator().manual_seed(1))
    slot = cells.find_slot(10)
    assert slot is not None
    positions = list(range(20, 30))
    cells.apply_ubatch(slot, np.array(positions), np.zeros(10, np.int64))
    for layer in range(storage.n_layers):
        storage.write(layer, torch.from_numpy(slot), rotated(x, positions, storage.rope), x)
    cells.seq_cp(0, 1, -1, -1)
    before = storage.k.clone()
    cells.seq_add(0, -1, -1, -20)
    cells.check()
    storage.apply(cells.take_pending())

    seq1_cells, seq1_pos = cells.seq_cells(1)
    assert seq1_pos.tolist() == positions
    idx = torch.from_numpy(seq1_cells)
    assert torch.equal(storage.k[:, :, idx], before[:, :, idx])  # bit-identical
    seq0_cells, seq0_pos = cells.seq_cells(0)
    assert seq0_pos.tolist() == list(range(10))
    assert not set(seq0_cells.tolist()) & set(seq1_cells.tolist())
    want = rotated(x, list(range(10)), storage.rope)
    for layer in range(storage.n_layers):
        k, v = storage.gather(layer, torch.from_numpy(seq0_cells))
        assert float((k - want).abs().max()) < 1e-5 and torch.equal(v, x)


def test_bytes_per_cell():
    assert make_storage().bytes_per_cell == 2 * 3 * 2 * 16 * 4
    assert make_storage(dtype=torch.bfloat16).bytes_per_cell == 2 * 3 * 2 * 16 * 2


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rot", [16, 8])  # full and partial rotary
def test_rope_tables_rotate_like_apply_rope(layout, rot):
    rope = RopeConfig(theta=10000.0, dim=rot, layout=layout)
    x = torch.randn(7, 3, 16, generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([0, 1, 5, 100, 2047, 9000, 3])
    cos, sin = rope.cos_sin(positions)
    c, s = rope_tables(cos, sin, 16, layout, torch.float32)
    fast = torch.addcmul(x * c, rope_partner(x, rot, layout), s)
    torch.testing.assert_close(fast, apply_rope(x, cos, sin, layout), atol=1e-6, rtol=0)
    assert torch.equal(fast[..., rot:], x[..., rot:])  # pass-through dims untouched


def test_a_run_of_cells_is_read_in_place_and_equals_the_gather():
    storage = make_storage(n_cells=32)
    x = torch.randn(32, 2, 16, generator=torch.Generator().manual_seed(4))
    for layer in range(storage.n_layers):
        storage.write(layer, torch.arange(32), x + layer, -x)
    run = storage.read_index(np.arange(5, 12))
    assert run == slice(5, 12)
    scattered = storage.read_index(np.array([5, 6, 8, 9]))
    assert isinstance(scattered, torch.Tensor)
    assert not isinstance(storage.read_index(np.array([7, 6, 5])), slice)  # a run must increase
    for layer in range(storage.n_layers):
        k, v = storage.gather_heads(layer, run)
        assert k.data_ptr() == storage.k[layer, 0, 5].data_ptr()  # a view, no copy
        assert torch.equal(k.transpose(0, 1), x[5:12] + layer) and torch.equal(
            v.transpose(0, 1), -x[5:12]
        )
        k, v = storage.gather_heads(layer, scattered)
        assert k.is_contiguous() and torch.equal(k.transpose(0, 1), x[[5, 6, 8, 9]] + layer)
