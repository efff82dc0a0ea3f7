"""The Hadamard rotation of quantized K/V cells (kvcache/rotation.py): the transform itself (the
C++ kernel against the float32 matmul), what it does to an outlier's block, the K-shift around
it, the cell files that record it, and a worker whose K has an outlier channel: q8_0 cells
with the rotation closer to the f32 cache than without."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache.cache_types import cache_type
from kvcache.cell_file import CellFileError, GroupRows, check_geometry
from kvcache.cells import PendingOps
from kvcache.rope import RopeConfig, apply_rope
from kvcache.rotation import ENV, hadamard, rotation_size
from kvcache.storage import KVStorage


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_the_size_is_the_largest_power_of_two_dividing_head_dim(monkeypatch):
    q8, f16 = cache_type("q8_0"), cache_type("f16")
    assert [rotation_size(q8, hd) for hd in (64, 96, 128, 160, 256)] == [64, 32, 128, 32, 256]
    assert rotation_size(cache_type("q4_0"), 128) == 128
    assert [rotation_size(q8, hd, v=True) for hd in (64, 96, 128, 256)] == [64, 32, 64, 64]
    assert rotation_size(f16, 128) == 0  # float types are stored as they are
    assert rotation_size(q8, 128, rotate=False) == 0
    monkeypatch.setenv(ENV, "0")
    assert rotation_size(q8, 128) == 0 and rotation_size(q8, 128, rotate=True) == 128
    monkeypatch.setenv(ENV, "maybe")
    with pytest.raises(ValueError, match=ENV):
        rotation_size(q8, 128)


@pytest.mark.parametrize("n", [1, 2, 32, 64, 128])
def test_the_transform_is_orthonormal_its_own_inverse_and_per_run(n):
    x = randn(5, 3, 128, seed=n)
    y = hadamard(x, n)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(hadamard(y, n), x, atol=1e-5)
    # dot products are kept: (H q) . (H k) = q . k
    assert torch.allclose((y[0] * y[1]).sum(-1), (x[0] * x[1]).sum(-1), atol=1e-4)
    if n < 128:  # a change in one run of n values changes only that run
        x2 = x.clone()
        x2[..., n:] += 1.0
        assert torch.equal(hadamard(x2, n)[..., :n], y[..., :n])
        assert not torch.equal(hadamard(x2, n)[..., n:], y[..., n:])
    if n == 2:  # H_2 = [[1, 1], [1, -1]] / sqrt(2)
        a, b = x[..., 0], x[..., 1]
        assert torch.allclose(y[..., 0], (a + b) / 2**0.5) and torch.allclose(
            y[..., 1], (a - b) / 2**0.5
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_transforms_a_strided_view_in_place_as_the_matmul_does(dtype):
    from tests.model.factories import require_kernels

    kernels = require_kernels()
    qkv = randn(7, 6 * 64, seed=1).to(dtype)  # [n, (h + 2 h_kv) hd]: q, k, v heads of 64
    ref = qkv.clone()
    qk = qkv[:, : 4 * 64].view(7, 4, 64)  # a view of qkv, as the layers pass it
    out = hadamard(qk, 32, kernels)
    assert out.data_ptr() == qkv.data_ptr()  # in place
    want = hadamard(ref[:, : 4 * 64].view(7, 4, 64), 32)  # the float32 matmul, rounded once
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(qkv[:, : 4 * 64].float(), want.reshape(7, -1).float(), atol=tol, rtol=tol)
    assert torch.equal(qkv[:, 4 * 64 :], ref[:, 4 * 64 :])  # v untouched
    with pytest.raises(RuntimeError, match="power of two"):
        kernels.hadamard_(qk, 48)


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_an_outlier_costs_its_block_less_when_rotated(name):
    """A K row of RMS ~11 with one value of 218 (Qwen2.5's layer 8, docs/performance.md):
    one scale per block of 32 makes the other 31 values coarse; rotated, the error of the
    row (measured back in k's basis) is less than half (q8_0: 8.7 against 22.7)."""
    t = cache_type(name)
    k = randn(64, 1, 128, seed=2) * 11
    k[:, 0, 5] = 218.0
    plain = t.decode(t.encode(k), torch.float32) - k
    rotated = hadamard(t.decode(t.encode(hadamard(k, 128)), torch.float32), 128) - k
    assert rotated.norm() * 2 < plain.norm(), (float(rotated.norm()), float(plain.norm()))


def test_a_rotated_q8_0_k_shift_turns_k_not_h_k():
    """The K-shift of rotated rows: undo H, RoPE by the delta, H again, quantize: what a row
    written at the shifted position would hold, to q8_0's precision."""
    rope = RopeConfig(theta=10000.0, dim=64)
    storage = KVStorage(2, 16, 2, 64, rope=rope, type_k="q8_0", type_v="q8_0", rotate=True)
    assert (storage.rot_k, storage.rot_v) == (64, 64)
    k = randn(4, 2, 64, seed=3)
    cells = torch.arange(4)
    cos, sin = rope.cos_sin(torch.tensor([3, 4, 5, 6]))
    at_p = apply_rope(k, cos, sin, rope.layout)
    storage.write(0, cells, hadamard(at_p, 64), hadamard(k, 64))  # as the layers store them
    z = np.zeros(0, np.int64)
    storage.apply(PendingOps(z, z.copy(), np.arange(4, dtype=np.int64), np.full(4, -3)))
    cos2, sin2 = rope.cos_sin(torch.tensor([0, 1, 2, 3]))
    want = apply_rope(k, cos2, sin2, rope.layout)
    got = hadamard(storage.gather(0, cells)[0].float(), 64)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    unrotated = storage.gather(0, cells)[0].float()  # the stored H k is not k
    assert (unrotated - want).abs().max() > 0.2 * want.abs().max()


def test_cell_files_record_the_rotation_and_refuse_the_other_kind():
    on = KVStorage(2, 8, 2, 64, type_k="q8_0", type_v="f16", rotate=True)
    off = KVStorage(2, 8, 2, 64, type_k="q8_0", type_v="f16", rotate=False)
    assert on.geometry()["k_rot"] == 64 and "v_rot" not in on.geometry()
    assert "k_rot" not in off.geometry()  # as files written before the rotation existed
    cells = torch.arange(3)
    k, v = on.read_cells(cells)
    saved_on = GroupRows(np.arange(3), k, v, (on.rot_k, on.rot_v))
    saved_off = GroupRows(np.arange(3), k, v)
    check_geometry([saved_on], [on.geometry()])
    check_geometry([saved_off], [off.geometry()])
    for rows, storage in ((saved_off, on), (saved_on, off)):
        with pytest.raises(CellFileError, match="does not match"):
            check_geometry([rows], [storage.geometry()])


@pytest.mark.model
@pytest.mark.parametrize("path", ["torch", "kernels"])
def test_a_k_outlier_channel_costs_less_with_the_rotation(tmp_path, path, monkeypatch):
    """A tiny Llama whose K has a large channel (one k projection row scaled 40x, as trained
    models' K outliers): teacher-forced q8_0 logits are closer to the f32 cache's with the
    rotation (the default) than without (CELLSERVE_KV_ROTATION=0), on the torch layers and on
    the C++ attention kernels."""
    from model import load_model
    from model.runner.worker import make_worker
    from tests.model.factories import require_kernels
    from tests.model.test_cache_types_worker import compare, forced_logits
    from tests.tiny_models import write_tiny_llama

    if path == "torch":
        monkeypatch.setenv("CELLSERVE_KERNELS", "0")
    else:
        require_kernels()
    loaded = load_model(write_tiny_llama(tmp_path / "model", dim=128), dtype="float32")
    args = loaded.transformer.args
    hd, h = args.head_dim, args.n_heads
    with torch.no_grad():
        for block in loaded.transformer.layers:
            block.mixer.wqkv.weight[h * hd + 3] *= 40.0  # kv head 0, dim 3
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    prompts = [torch.randint(3, vocab, (24 + 3 * s,), generator=gen).tolist() for s in range(4)]
    conts = [torch.randint(3, vocab, (12,), generator=gen).tolist() for _ in range(4)]

    def run(type_k: str, rotate: str) -> torch.Tensor:
        monkeypatch.setenv(ENV, rotate)
        worker = make_worker(loaded, 256, cache_type_k=type_k, cache_type_v=type_k)
        assert worker.kv[0].rot_k == (hd if type_k == "q8_0" and rotate == "1" else 0)
        return forced_logits(worker, prompts, conts)

    ref = run("f32", "1")
    agree_plain, kl_plain = compare(ref, run("q8_0", "0"))
    agree, kl_rotated = compare(ref, run("q8_0", "1"))
    # torch path, Xeon: KL 0.105 against 0.756, top-1 0.92
    assert kl_rotated * 3 < kl_plain and agree >= agree_plain, (kl_rotated, kl_plain, agree)
