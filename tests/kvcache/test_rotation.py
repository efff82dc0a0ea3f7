"""The Hadamard rotation and the K centring of quantized K/V cells (kvcache/rotation.py): the
transform itself (the C++ kernel against the float32 matmul), what it does to an outlier's
block, the K-shift around both, the cell files that record them, and workers whose K has an
outlier channel (q8_0 closer to the f32 cache with the rotation than without) or a large
bias in its slowest RoPE pair (q8_0 / q4_0 closer centred than rotated alone), on the torch
layers, the C++ attention and the one-call step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache.cache_types import cache_type
from kvcache.cell_file import CellFileError, GroupRows, check_geometry
from kvcache.cells import PendingOps
from kvcache.rope import RopeConfig, apply_rope
from kvcache.rotation import ENV, hadamard, k_center, rotation_size
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
    saved_on = GroupRows(np.arange(3), k, v, (on.rot_k, on.rot_v, False))
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


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_k_center_is_the_mean_of_the_rotated_bias(layout):
    rope = RopeConfig(theta=10000.0, dim=48, layout=layout)  # partial: 16 dims not rotated
    bias = randn(2, 64, seed=4)
    cos, sin = rope.cos_sin(torch.arange(300))
    want = apply_rope(bias[None].expand(300, 2, 64), cos, sin, layout).mean(0)
    got = k_center(bias, rope, 300)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert torch.equal(got[:, 48:], bias[:, 48:])  # the unrotated dims keep their bias
    assert torch.equal(k_center(bias, None, 300), bias)  # NoPE
    # the slowest pairs of a long context keep nearly all of it, the fastest nearly none
    long = k_center(bias, RopeConfig(theta=1e6, dim=64), 32768)
    slow, fast = (31, 63), (0, 32)
    assert torch.allclose(long[:, slow], bias[:, slow], rtol=0.05)
    assert long[:, fast].abs().max() < 0.01 * bias.abs().max()


def test_a_centred_rotated_k_shift_turns_k():
    """Rows stored as H (k - c): the K-shift adds c back around RoPE."""
    rope = RopeConfig(theta=10000.0, dim=64)
    storage = KVStorage(2, 16, 2, 64, rope=rope, type_k="q8_0", type_v="q8_0", rotate=True)
    bias = torch.zeros(2, 64)
    bias[:, [31, 63]] = 40.0  # the slowest pair of each kv head
    storage.center_k(1, bias, 4096)
    assert 0 not in storage.k_centers and storage.geometry()["k_centered"] is True
    c = storage.k_center(1, torch.float32)
    assert c is not None  # the pair turns ~0.55 rad over 4096 positions: most of it is kept
    assert float(c[:, [31, 63]].norm()) > 0.95 * float(bias[:, [31, 63]].norm())
    k = randn(4, 2, 64, seed=6) + bias
    cos, sin = rope.cos_sin(torch.tensor([3, 4, 5, 6]))
    at_p = apply_rope(k, cos, sin, rope.layout)
    storage.write(1, torch.arange(4), hadamard(at_p - c, 64), hadamard(k, 64))
    z = np.zeros(0, np.int64)
    storage.apply(PendingOps(z, z.copy(), np.arange(4, dtype=np.int64), np.full(4, -3)))
    want = apply_rope(k, *rope.cos_sin(torch.tensor([0, 1, 2, 3])), rope.layout)
    got = hadamard(storage.gather(1, torch.arange(4))[0].float(), 64) + c
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    plain = KVStorage(2, 16, 2, 64, type_k="f16", type_v="q8_0", rotate=True)
    plain.center_k(1, bias, 4096)  # float K rows: stored as they are
    assert not plain.k_centers and "k_centered" not in plain.geometry()


def write_biased_qwen2(folder, value: float = 200.0):
    """A tiny Qwen2 (head_dim 32, 2048 positions, RoPE base 1e6 as Qwen2.5's) whose K bias
    holds `value` in the slowest RoPE pair of each kv head (dims 15 and 31), as Qwen2.5's layer
    0 does: that pair turns 0.005 rad over the context."""
    import json

    from safetensors.torch import load_file, save_file

    from tests.tiny_models import write_tiny_llama

    path = write_tiny_llama(folder, dim=128, model_type="qwen2")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"rope_theta": 1e6}))
    tensors = load_file(path / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith("k_proj.bias"):
            t.view(-1, 32)[:, [15, 31]] = value
    save_file(tensors, path / "model.safetensors")
    return path


@pytest.mark.model
@pytest.mark.parametrize("path", ["torch", "kernels"])
def test_a_constant_k_channel_costs_less_centred(tmp_path, path, monkeypatch):
    """The biased Qwen2: teacher-forced q4_0 / q8_0 logits against the f32 cache's, with the
    rotation and the centring (the default), with the rotation alone, and with neither."""
    from model import load_model
    from model.runner.worker import make_worker
    from tests.model.factories import require_kernels
    from tests.model.test_cache_types_worker import compare, forced_logits

    if path == "torch":
        monkeypatch.setenv("CELLSERVE_KERNELS", "0")
    else:
        require_kernels()
    loaded = load_model(write_biased_qwen2(tmp_path / "model"), dtype="float32")
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    prompts = [torch.randint(3, vocab, (24 + 3 * s,), generator=gen).tolist() for s in range(4)]
    conts = [torch.randint(3, vocab, (12,), generator=gen).tolist() for _ in range(4)]

    def run(t: str, how: str) -> torch.Tensor:
        with monkeypatch.context() as m:
            m.setenv(ENV, "0" if how == "plain" else "1")
            if how == "rotated":
                m.setattr(KVStorage, "center_k", lambda *a: None)
            worker = make_worker(loaded, 256, cache_type_k=t, cache_type_v=t)
            assert bool(worker.kv[0].k_centers) == (how == "centred" and t != "f32")
            return forced_logits(worker, prompts, conts)

    ref = run("f32", "centred")
    for t in ("q8_0", "q4_0"):
        kl = {how: compare(ref, run(t, how))[1] for how in ("plain", "rotated", "centred")}
        assert kl["centred"] * 3 < min(kl["plain"], kl["rotated"]), (t, kl)


@pytest.mark.model
def test_the_one_call_step_centres_as_the_python_layers_do(tmp_path, monkeypatch):
    """int4 weights take the one-call C++ step: centred there too (closer to the f32 cache than
    rotated alone), and steps that alternate between it and the Python layers over the same
    cells (as LoRA rows make them) read what the other wrote."""
    from model import load_model
    from model.layers.quant import quantize
    from model.runner.native import NativeDecoder
    from model.runner.worker import make_worker
    from tests.model.factories import require_kernels
    from tests.model.test_cache_types_worker import compare, forced_logits

    require_kernels()
    loaded = load_model(write_biased_qwen2(tmp_path / "model"), dtype="bfloat16")
    quantize(loaded.transformer, "int4")
    prompts = [[(7 * i + 13 * s) % 300 + 5 for i in range(12 + 5 * s)] for s in range(3)]
    conts = [[(11 * i + s) % 300 + 5 for i in range(10)] for s in range(3)]
    calls: list[int] = []
    runs = NativeDecoder.runs
    alternate = False

    def counted(self, batch):  # noqa: ANN001, ANN202
        if alternate and len(calls) % 2:
            calls.append(0)
            return False
        took = runs(self, batch)
        calls.append(int(took))
        return took

    monkeypatch.setattr(NativeDecoder, "runs", counted)

    def run(t: str, centred: bool = True) -> torch.Tensor:
        with monkeypatch.context() as m:
            if not centred:
                m.setattr(KVStorage, "center_k", lambda *a: None)
            worker = make_worker(loaded, 256, cache_type_k=t, cache_type_v=t)
        assert bool(worker.kv[0].k_centers) == (centred and t != "bf16")
        assert worker.paths.native is not None, worker.paths.describe()
        calls.clear()
        out = forced_logits(worker, prompts, conts)
        assert sum(calls) >= (5 if alternate else 10)  # one C++ call for a step
        return out

    ref = run("bf16")
    kl = {how: compare(ref, run("q8_0", how == "centred"))[1] for how in ("rotated", "centred")}
    assert kl["centred"] * 3 < kl["rotated"], kl
    native = run("q8_0")
    alternate = True
    agree, mixed = compare(native, run("q8_0"))
    assert agree >= 0.95 and mixed < 1e-2, (agree, mixed)


@pytest.mark.model
def test_no_centre_where_the_softmax_is_not_shift_invariant(tmp_path):
    """gpt-oss has K biases, but its sinks take a share of each softmax: scores moved by q . c
    would change that share, so its quantized K rows are rotated, never centred."""
    from model import load_model
    from model.runner.worker import make_worker
    from tests.tiny_gptoss import write_tiny_gptoss

    loaded = load_model(write_tiny_gptoss(tmp_path / "gptoss", seed=1), dtype="float32")
    args = loaded.transformer.args
    assert all(args.layer_desc(i).qkv_bias for i in range(args.n_layers))  # it has K biases
    attention = [b.mixer for b in loaded.transformer.layers]
    assert all(a.sinks is not None and a.k_bias is None for a in attention)
    worker = make_worker(loaded, 64, cache_type_k="q8_0", cache_type_v="q8_0")
    assert all(s.rot_k and not s.k_centers for s in worker.kv if isinstance(s, KVStorage))
    biased = load_model(write_biased_qwen2(tmp_path / "qwen2"), dtype="float32")
    assert all(b.mixer.k_bias is not None for b in biased.transformer.layers)
