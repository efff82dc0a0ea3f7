"""model/kernels: the C++ decode attention against a float64 reference over gathered cells."""

from __future__ import annotations

import os

import pytest
import torch

from model.kernels import load_decode_attention, load_kernels


@pytest.fixture(scope="module")
def kernel():
    fn = load_decode_attention()
    if fn is None:
        if os.environ.get("CELLSERVE_REQUIRE_TOOLS") == "1":
            pytest.fail("the decode attention kernel did not build (C++ compiler / ninja?)")
        pytest.skip("no C++ toolchain: the model keeps the gather + SDPA path")
    return fn


def reference(q, k, v, cells, lens, scale):
    """Per sequence: gather its first lens[s] cells, GQA by repeating kv heads, float64."""
    n_seq, n_heads, hd = q.shape
    group = n_heads // k.shape[0]
    out = []
    for s in range(n_seq):
        idx = cells[s, : lens[s]]
        ks = k[:, idx].double().repeat_interleave(group, dim=0)  # [n_heads, n, hd]
        vs = v[:, idx].double().repeat_interleave(group, dim=0)
        probs = torch.softmax(torch.einsum("hd,hnd->hn", q[s].double() * scale, ks), dim=-1)
        out.append(torch.einsum("hn,hnd->hd", probs, vs))
    return torch.stack(out)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matches_the_reference_on_scattered_padded_cells(kernel, dtype, tol):
    gen = torch.Generator().manual_seed(0)
    n_cells, n_kv, n_heads, hd = 200, 3, 9, 64
    store_k = torch.randn(n_kv, n_cells + 50, hd, generator=gen).to(dtype)
    store_v = torch.randn(n_kv, n_cells + 50, hd, generator=gen).to(dtype)
    k, v = store_k[:, 10 : 10 + n_cells], store_v[:, 10 : 10 + n_cells]  # strided views
    lens = torch.tensor([37, 1, 60, 12])
    cells = torch.stack([torch.randperm(n_cells, generator=gen)[:60] for _ in lens])
    q = torch.randn(len(lens), n_heads, hd, generator=gen).to(dtype)
    got = kernel(q, k, v, cells, lens, 0.125)
    want = reference(q, k, v, cells, lens, 0.125)
    assert got.dtype == dtype and got.shape == q.shape
    assert float((got.double() - want).abs().max()) < tol
    cells[0, 37:] = 0  # past lens: never read
    assert torch.equal(kernel(q, k, v, cells, lens, 0.125), got)


@pytest.mark.parametrize("n_heads, n_kv, hd", [(9, 3, 64), (8, 2, 128), (6, 3, 48)])
def test_bfloat16_blocks_tails_and_head_sizes(kernel, n_heads, n_kv, hd):
    """bfloat16 with head_dim % 32 == 0 takes the AVX-512 BF16 path where the CPU has it (16-row
    score blocks, row pairs for P V): lengths around the block and pair edges; 48 takes the
    generic loop. Tolerance: bfloat16 probabilities and output, as in the torch path."""
    gen = torch.Generator().manual_seed(1)
    n_cells = 700
    k = torch.randn(n_kv, n_cells, hd, generator=gen).bfloat16()
    v = torch.randn(n_kv, n_cells, hd, generator=gen).bfloat16()
    lens = torch.tensor([333, 1, 2, 15, 16, 17, 32, 64])
    cells = torch.stack([torch.randperm(n_cells, generator=gen)[:333] for _ in lens])
    q = torch.randn(len(lens), n_heads, hd, generator=gen).bfloat16()
    scale = hd**-0.5
    got = kernel(q, k, v, cells, lens, scale)
    want = reference(q, k, v, cells, lens, scale)
    assert float((got.double() - want).abs().max()) < 2e-2
    # every output row is its own: the same sequences one at a time give the same values
    for s in (0, 3, 5):
        alone = kernel(q[s : s + 1], k, v, cells[s : s + 1], lens[s : s + 1], scale)
        assert torch.equal(alone[0], got[s])


def test_refuses_mismatched_inputs(kernel):
    q = torch.randn(2, 4, 16)
    k = torch.randn(2, 8, 16)
    cells = torch.zeros(2, 3, dtype=torch.int64)
    lens = torch.ones(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="dtype"):
        kernel(q, k.double(), k.double(), cells, lens, 1.0)
    with pytest.raises(RuntimeError, match="multiple"):
        kernel(torch.randn(2, 3, 16), k, k, cells, lens, 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        kernel(q, k, k, cells.int(), lens, 1.0)
    for bad in (0, 4):  # nothing to attend / past the cells given
        with pytest.raises(RuntimeError, match=r"lens\[1\] = "):
            kernel(q, k, k, cells, torch.tensor([1, bad]), 1.0)


@pytest.fixture(scope="module")
def prompt_kernel(kernel):
    module = load_kernels()
    if not module.has_bf16_kernels():
        pytest.skip("no AVX-512 BF16 on this CPU: prompts keep SDPA")
    return module.prompt_attention


@pytest.mark.parametrize("n_heads, n_kv, hd", [(9, 3, 64), (8, 2, 128), (4, 4, 32)])
@pytest.mark.parametrize("past", [0, 21])
def test_prompt_attention_is_causal_over_position_ordered_cells(
    prompt_kernel, n_heads, n_kv, hd, past
):
    """Row i of a prompt chunk sees the first lens[i] of the position-ordered cells: the float64
    reference per row, rows in blocks of several per task (37 rows: a partial last block)."""
    gen = torch.Generator().manual_seed(3)
    n_cells, L = 300, 37
    k = torch.randn(n_kv, n_cells, hd, generator=gen).bfloat16()
    v = torch.randn(n_kv, n_cells, hd, generator=gen).bfloat16()
    cells = torch.randperm(n_cells, generator=gen)[: past + L]
    lens = torch.arange(past + 1, past + L + 1)
    q = torch.randn(L, n_heads, hd, generator=gen).bfloat16()
    scale = hd**-0.5
    got = prompt_kernel(q, k, v, cells, lens, scale)
    want = reference(q, k, v, cells.expand(L, -1), lens, scale)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    assert float((got.double() - want).abs().max()) < 2e-2
    # a row's output does not depend on the rows it shares a task with: every row alone
    for r in range(L):
        alone = prompt_kernel(q[r : r + 1], k, v, cells, lens[r : r + 1], scale)
        assert torch.equal(alone[0], got[r]), r
    with pytest.raises(RuntimeError, match="bfloat16"):
        prompt_kernel(q.float(), k.float(), v.float(), cells, lens, scale)
    with pytest.raises(RuntimeError, match="is not in"):
        prompt_kernel(q[:1], k, v, cells[:3], torch.tensor([4]), scale)


def test_fused_rms_norm_and_silu_mul_round_as_torch_does(kernel):
    """The bfloat16 RMSNorm and SiLU-mul the model uses when the kernels are built: torch's
    values up to float32 summation order / exp ulps (at most one bfloat16 step, rarely)."""
    module = load_kernels()
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(33, 576, generator=gen) * 3).bfloat16()
    w = (torch.rand(576, generator=gen) + 0.5).bfloat16()
    want = torch.nn.functional.rms_norm(x, (576,), w, 1e-5)
    got = module.rms_norm_bf16(x, w, 1e-5)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert float((got != want).float().mean()) < 0.01
    torch.testing.assert_close(got, want, atol=0, rtol=2**-7)  # one bfloat16 step
    gate_up = (torch.randn(33, 2 * 96, generator=gen) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = module.silu_mul_bf16(gate_up)
    assert got.shape == want.shape
    assert float((got != want).float().mean()) < 0.01
    torch.testing.assert_close(got, want, atol=1e-2, rtol=2**-7)


@pytest.mark.slow
def test_builds_and_runs_without_avx512(kernel, tmp_path):
    """The kernels compiled for an AVX2-only x86 CPU (no AVX-512 BF16): the generic decode
    attention and fused ops work, prompt_attention refuses and has_bf16_kernels says why."""
    import platform

    from torch.utils import cpp_extension

    from model.kernels import SOURCES

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 build check")
    module = cpp_extension.load(
        name="cellserve_decode_avx2",
        sources=[str(path) for path in SOURCES],
        extra_cflags=["-O3", "-march=x86-64-v3", "-ffast-math", "-fopenmp"],
        build_directory=str(tmp_path),
    )
    assert not module.has_bf16_kernels()
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 9, 64, generator=gen).bfloat16()
    k = torch.randn(3, 50, 64, generator=gen).bfloat16()
    cells, lens = torch.arange(40).view(2, 20), torch.tensor([20, 7])
    want = reference(q, k, k, cells, lens, 0.125)
    assert (
        float((module.decode_attention(q, k, k, cells, lens, 0.125).double() - want).abs().max())
        < 2e-2
    )
    with pytest.raises(RuntimeError, match="AVX-512 BF16"):
        module.prompt_attention(q, k, k, torch.arange(20), torch.tensor([1, 2]), 0.125)
