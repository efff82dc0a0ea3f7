"""model/kernels: the C++ decode and prompt attention against a float64 reference over gathered
cells, and the fused RMSNorm / SiLU-mul / RoPE ops against torch, on the build the dispatcher
picks (every ISA level's build: test_kernel_builds.py)."""

from __future__ import annotations

import pytest
import torch

from model.kernels import isa, load_kernels
from tests.model.factories import require_kernels


@pytest.fixture(scope="module")
def kernel():
    return require_kernels().decode_attention


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


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32])
def prompt_kernel(kernel, request):
    module = load_kernels()
    dtype = request.param
    if dtype == torch.bfloat16 and not module.has_bf16_kernels():
        pytest.skip(
            f"no AVX-512 BF16 at ISA level {isa.active_level()}: bfloat16 prompts keep SDPA"
        )
    if dtype == torch.float32 and not module.has_f32_kernels():
        pytest.skip(f"no AVX2 at ISA level {isa.active_level()}: float32 prompts keep SDPA")
    return module.prompt_attention, dtype


@pytest.mark.parametrize("n_heads, n_kv, hd", [(9, 3, 64), (8, 2, 128), (4, 4, 32)])
@pytest.mark.parametrize("past", [0, 21])
def test_prompt_attention_is_causal_over_position_ordered_cells(
    prompt_kernel, n_heads, n_kv, hd, past
):
    """Row i of a prompt chunk sees the first lens[i] of the position-ordered cells: the float64
    reference per row, rows in blocks of several per task (37 rows: a partial last block), in
    bfloat16 (AVX-512 BF16) and float32 (AVX2 and up)."""
    kernel, dtype = prompt_kernel
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    gen = torch.Generator().manual_seed(3)
    n_cells, L = 300, 37
    k = torch.randn(n_kv, n_cells, hd, generator=gen).to(dtype)
    v = torch.randn(n_kv, n_cells, hd, generator=gen).to(dtype)
    cells = torch.randperm(n_cells, generator=gen)[: past + L]
    lens = torch.arange(past + 1, past + L + 1)
    q = torch.randn(L, n_heads, hd, generator=gen).to(dtype)
    scale = hd**-0.5
    got = kernel(q, k, v, cells, lens, scale)
    want = reference(q, k, v, cells.expand(L, -1), lens, scale)
    assert got.shape == q.shape and got.dtype == dtype
    assert float((got.double() - want).abs().max()) < tol
    # a row's output does not depend on the rows it shares a task with: every row alone
    for r in range(L):
        alone = kernel(q[r : r + 1], k, v, cells, lens[r : r + 1], scale)
        assert torch.equal(alone[0], got[r]), r
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel(q.double(), k.double(), v.double(), cells, lens, scale)
    with pytest.raises(RuntimeError, match="is not in"):
        kernel(q[:1], k, v, cells[:3], torch.tensor([4]), scale)


@pytest.mark.parametrize("n_heads, n_kv, hd", [(4, 1, 32), (8, 2, 128)])
@pytest.mark.parametrize("window", [5, 16])
def test_prompt_attention_reads_each_rows_window(prompt_kernel, n_heads, n_kv, hd, window):
    """A sliding window's chunk: row i sees cells[firsts[i]:lens[i]] (the last `window` of its
    causal prefix): the float64 reference per row; a row alone (a task whose first cell is
    its own) gets the bits it gets in the chunk; firsts outside [0, lens) are refused."""
    kernel, dtype = prompt_kernel
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    gen = torch.Generator().manual_seed(5)
    n_cells, past, L = 200, 9, 37
    k = torch.randn(n_kv, n_cells, hd, generator=gen).to(dtype)
    v = torch.randn(n_kv, n_cells, hd, generator=gen).to(dtype)
    cells = torch.randperm(n_cells, generator=gen)[: past + L]
    lens = torch.arange(past + 1, past + L + 1)
    firsts = (lens - window).clamp(min=0)
    q = torch.randn(L, n_heads, hd, generator=gen).to(dtype)
    scale = hd**-0.5
    got = kernel(q, k, v, cells, lens, scale, firsts=firsts)
    rows = torch.stack([torch.roll(cells, -int(f)) for f in firsts])  # row i's cells first
    want = reference(q, k, v, rows, lens - firsts, scale)
    assert float((got.double() - want).abs().max()) < tol
    full = kernel(q, k, v, cells, lens, scale)
    assert not torch.allclose(got.float(), full.float(), atol=tol)  # the window cut cells
    for r in range(L):
        alone = kernel(q[r : r + 1], k, v, cells, lens[r : r + 1], scale, firsts=firsts[r : r + 1])
        assert torch.equal(alone[0], got[r]), r
    with pytest.raises(RuntimeError, match=r"firsts\[0\] = 3 is not in \[0, lens\[0\] = 3\)"):
        kernel(q[:1], k, v, cells, torch.tensor([3]), scale, firsts=torch.tensor([3]))
    with pytest.raises(RuntimeError, match="firsts must be"):
        kernel(q[:2], k, v, cells, lens[:2], scale, firsts=firsts[:1])


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


def test_fused_float32_rms_norm_and_silu_mul_match_torch(kernel):
    """The float32 twins (the quantized float32 models' fused ops, both paths): torch's values
    up to float32 summation order; `rms_norm` / `silu_mul` pick the kernel by dtype."""
    module = load_kernels()
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(33, 576, generator=gen) * 3, torch.rand(576, generator=gen) + 0.5
    want = torch.nn.functional.rms_norm(x, (576,), w, 1e-5)
    for got in (module.rms_norm_f32(x, w, 1e-5), module.rms_norm(x, w, 1e-5)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    gate_up = torch.randn(33, 2 * 96, generator=gen) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    for got in (module.silu_mul_f32(gate_up), module.silu_mul(gate_up)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert module.rms_norm(x.bfloat16(), w.bfloat16(), 1e-5).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="float32"):
        module.rms_norm_f32(x.bfloat16(), w, 1e-5)


def rope_reference(qk, c, s):
    """model/layers/decoder.py's torch RoPE (rotate-half over the whole head)."""
    half = qk.shape[-1] // 2
    partner = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
    return torch.addcmul(qk * c, partner, s)


def rope_case(dtype, n=5, heads=12, hd=64, seed=8):
    """qk: a [n, heads, hd] view of a wider qkv row (as the model's), and its tables."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(n, (heads + 3) * hd, generator=gen) * 4).to(dtype)
    angles = torch.rand(n, hd // 2, generator=gen) * 300
    c = torch.cat((angles.cos(), angles.cos()), -1)[:, None].to(dtype)
    s = torch.cat((-angles.sin(), angles.sin()), -1)[:, None].to(dtype)
    return qkv, qkv[:, : heads * hd].view(n, heads, hd), c, s


def test_fused_rope_rounds_as_torch_does_in_place(kernel):
    """rope_neox_ rotates a strided view in place, bit for bit torch's mul + addcmul: bfloat16
    rounding after each, float32 with addcmul's FMA; the rest of the row is left alone."""
    module = load_kernels()
    for dtype in (torch.bfloat16, torch.float32):
        qkv, qk, c, s = rope_case(dtype)
        want, rest = rope_reference(qk, c, s), qkv[:, qk.shape[1] * 64 :].clone()
        got = module.rope_neox_(qk, c, s)
        assert got.data_ptr() == qk.data_ptr() and got.dtype == dtype
        assert torch.equal(qk, want)
        assert torch.equal(qkv[:, qk.shape[1] * 64 :], rest)
    qkv, qk, c, s = rope_case(torch.bfloat16, n=300)  # past the threaded-pass threshold
    want = rope_reference(qk, c, s)
    assert torch.equal(module.rope_neox_(qk, c, s), want)


def test_fused_rope_refuses_mismatched_inputs(kernel):
    module = load_kernels()
    _, qk, c, s = rope_case(torch.float32)
    with pytest.raises(RuntimeError, match="dtype"):
        module.rope_neox_(qk, c.bfloat16(), s.bfloat16())
    with pytest.raises(RuntimeError, match=r"\[n, 1, head_dim\]"):
        module.rope_neox_(qk, c[:2], s[:2])
    with pytest.raises(RuntimeError, match="even head_dim"):
        module.rope_neox_(qk[..., :63], c, s)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        module.rope_neox_(qk.double(), c.double(), s.double())
