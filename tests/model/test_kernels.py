"""model/kernels: the C++ decode attention against a float64 reference over gathered cells, on
the build the dispatcher picks; then every ISA level's build (model/kernels/isa.py): the
dispatcher's choice, each build's instructions within its level, and the same logits as the
torch path from each."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from model import kernels as kernel_builds
from model import load_model
from model.kernels import isa, load_kernels
from model.runner.worker import make_worker
from tests.model.factories import Driver, require_kernels
from tests.model.test_ggml_blocks import QUANT_TYPES, check_row_alone_equals_it_in_a_batch
from tests.tiny_models import write_tiny_llama


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


def check_module(module) -> None:
    """A build's decode attention (float32, bfloat16) and fused ops against the references."""
    gen = torch.Generator().manual_seed(5)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(2, 9, 64, generator=gen).to(dtype)
        k = torch.randn(3, 50, 64, generator=gen).to(dtype)
        cells, lens = torch.arange(40).view(2, 20), torch.tensor([20, 7])
        want = reference(q, k, k, cells, lens, 0.125)
        got = module.decode_attention(q, k, k, cells, lens, 0.125)
        assert float((got.double() - want).abs().max()) < tol, (module.LEVEL, dtype)
    x = torch.randn(5, 576, generator=gen).bfloat16()
    w = (torch.rand(576, generator=gen) + 0.5).bfloat16()
    want = torch.nn.functional.rms_norm(x, (576,), w, 1e-5)
    torch.testing.assert_close(module.rms_norm_bf16(x, w, 1e-5), want, atol=0, rtol=2**-7)
    if not module.has_bf16_kernels():
        with pytest.raises(RuntimeError, match="AVX-512 BF16"):
            module.prompt_attention(q, k, k, torch.arange(20), torch.tensor([1, 2]), 0.125)
    assert module.has_f32_kernels() == ("avx2" in module.compiled_isa())
    if not module.has_f32_kernels():
        q, k = q.float(), k.float()
        with pytest.raises(RuntimeError, match="AVX2"):
            module.prompt_attention(q, k, k, torch.arange(20), torch.tensor([1, 2]), 0.125)


def test_dispatcher_picks_the_best_built_level_the_cpu_runs(monkeypatch):
    require_kernels()
    detected = isa.detected_level()
    status = kernel_builds.choose()
    assert status.level in kernel_builds.built_levels()
    assert isa.LEVELS.index(status.level) <= isa.LEVELS.index(isa.active_level())
    assert status.level == load_kernels().LEVEL
    # every level this CPU runs is built (make install), so the choice is the active level
    assert set(kernel_builds.levels_for_this_cpu()) <= set(kernel_builds.built_levels())
    assert status.level == isa.active_level()
    for forced in kernel_builds.levels_for_this_cpu():
        monkeypatch.setenv("CELLSERVE_ISA", forced)
        assert kernel_builds.choose().level == forced
    if detected != "avx512_bf16":  # a level above the CPU's is capped at the CPU's
        monkeypatch.setenv("CELLSERVE_ISA", "avx512_bf16")
        assert isa.active_level() == detected
    monkeypatch.setenv("CELLSERVE_ISA", "avx9")
    with pytest.raises(ValueError, match="avx9"):
        isa.active_level()


def test_levels_follow_the_cpu_flags():
    zen3 = frozenset(["sse2", "avx", "avx2", "fma", "f16c", "bmi2", "popcnt"])
    skylake = zen3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
    zen4 = skylake | {"avx512_vnni", "avx512_bf16"}
    assert isa.detected_level(frozenset({"sse2", "avx"})) == "generic"
    assert isa.detected_level(zen3) == "avx2"
    assert isa.detected_level(skylake) == "avx512"
    assert isa.detected_level(skylake | {"avx512_bf16"}) == "avx512"  # BF16 without VNNI: none
    assert isa.detected_level(zen4) == "avx512_bf16"
    assert isa.library_env("avx2")["ATEN_CPU_CAPABILITY"] == "avx2"
    # a build's name depends on its level's flags: one level's build never loads as another's
    names = {kernel_builds.module_name(level) for level in kernel_builds.arch_levels()}
    assert len(names) == len(kernel_builds.arch_levels())


@pytest.mark.parametrize("level", kernel_builds.levels_for_this_cpu())
def test_each_build_uses_only_its_levels_instructions_and_matches_the_reference(level):
    """The guard against an illegal instruction on a smaller CPU: what a level's build was
    compiled for is within what that level requires of a CPU."""
    module = require_kernels(level)
    compiled = set(module.compiled_isa().split())
    if isa.is_x86():
        allowed = set(isa._NEEDS.get(level, frozenset()))
        assert compiled <= allowed, (level, compiled - allowed)
        assert ("avx512_bf16" in compiled) == (level == "avx512_bf16")
        assert module.has_bf16_kernels() == (level == "avx512_bf16")
    check_module(module)


@pytest.mark.parametrize("level", kernel_builds.levels_for_this_cpu())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_build_gives_the_torch_paths_logits(tmp_path_factory, monkeypatch, level, dtype):
    """A tiny Llama's prefill and decode logits with one level's kernels (the decode and prompt
    attention, the fused bfloat16 ops) against the same model without any C++ kernel."""
    import model.runner.worker

    module = require_kernels(level)
    folder = write_tiny_llama(tmp_path_factory.mktemp("tiny"), dim=128, n_heads=4)  # hd 32
    loaded = load_model(folder, dtype=dtype)
    prompts = [[(7 * i + 5 * n) % 300 + 5 for i in range(n)] for n in (30, 24, 33)]
    runs = []
    for kernels in (module, None):
        monkeypatch.setattr(model.runner.worker, "load_kernels", lambda k=kernels: k)
        worker = make_worker(loaded, n_cells=256)
        driver = Driver(worker, 256, seed=7)
        a = driver.logits([driver.chunk(s, p, all_rows=True) for s, p in enumerate(prompts)])
        b = driver.logits([driver.chunk(s, [17]) for s in range(len(prompts))])
        runs.append(torch.cat([a, b]).float())
    spread = float(runs[1].max() - runs[1].min())
    # float32: summation order only; bfloat16: the kernels' float32 sums vs torch's bfloat16
    # rounding steps, a few bfloat16 ulps of the logit range
    tol = 1e-4 if dtype == "float32" else 3e-2
    assert float((runs[0] - runs[1]).abs().max()) < tol * spread, level
    agree = float((runs[0].argmax(-1) == runs[1].argmax(-1)).float().mean())
    assert agree >= (1.0 if dtype == "float32" else 0.95), (level, agree)


@pytest.mark.slow
def test_the_generic_build_compiles_and_runs(tmp_path, monkeypatch):
    """The portable build (aarch64 / x86 before AVX2; here with -march=x86-64): compiles
    without any vector extension and gives the reference values."""
    require_kernels()  # a toolchain is here
    monkeypatch.setenv("CELLSERVE_KERNEL_DIR", str(tmp_path))
    (result,) = kernel_builds.build_kernels(["generic"])
    assert result.error is None, result.error
    module = load_kernels("generic")
    assert "avx2" not in module.compiled_isa() and not module.has_bf16_kernels()
    check_module(module)
    check_int4(module, "generic")
    for name in QUANT_TYPES:  # the GGUF blocks' portable kernels
        check_row_alone_equals_it_in_a_batch(module, name)


@pytest.mark.parametrize("level", kernel_builds.levels_for_this_cpu())
def test_int4_mm_and_int4_gemm_match_the_dequantized_weights(level):
    """float32 rows times int4 weights on each build (AVX-512 VNNI, AVX2, portable: the
    portable one in test_the_generic_build_runs_anywhere) by int4_mm (model/kernels/int4.cpp,
    small batches) and int4_gemm (gemm.cpp, large ones): check_int4."""
    check_int4(require_kernels(level), level)


def check_int4(module: Any, level: str) -> None:
    """Both kernels give the rows quantized to int8 per group of 32 (quantize_rows_q8) times
    the dequantized weights in float64, to float32's rounding, for row counts over and under
    their tiles and output counts off their blocks (int4_gemm's 8-output blocks padded); within
    the int8 rounding of the float32 product; and int4_gemm gives a row the same bits in any
    batch (what a batch_invariant worker relies on)."""
    from model.layers.quant import (
        dequantize_int4,
        pack_int4,
        pack_int4_gemm,
        quantize_int4,
        quantize_rows_q8,
    )

    gen = torch.Generator().manual_seed(3)
    for n, k, m in ((7, 64, 1), (130, 576, 2), (61, 96, 3), (96, 1536, 9), (70, 128, 37)):
        q, scales_zeros = quantize_int4(torch.randn(n, k, generator=gen))
        scales_zeros = scales_zeros.bfloat16()
        w = dequantize_int4(q, scales_zeros.float()).double()
        x = torch.randn(m, k, generator=gen)
        x[0, :32] = 0.0  # an all-zero group: scale 0, no division by it
        xq, d, _ = quantize_rows_q8(x)
        xq8 = (xq.view(m, k // 32, 32).double() * d.double()[..., None]).view(m, k)
        want = xq8 @ w.T
        # each activation moves by at most half a step d / 2 of its group
        bound = (d.double().repeat_interleave(32, 1) / 2) @ w.abs().T
        gemm_w = pack_int4_gemm(q, scales_zeros)
        for name, y in (
            ("int4_mm", module.int4_mm(x, *pack_int4(q, scales_zeros))),
            ("int4_gemm", module.int4_gemm(x, gemm_w, n)),
        ):
            assert y.shape == (m, n) and y.dtype == torch.float32
            err = float((y.double() - want).abs().max())
            assert err < 1e-5 * float(want.abs().max()) * k**0.5, (level, name, n, k, m, err)
            assert bool(((y.double() - x.double() @ w.T).abs() <= bound + 1e-4).all()), name
        batch = module.int4_gemm(x, gemm_w, n)
        for r in range(m):
            assert torch.equal(module.int4_gemm(x[r : r + 1], gemm_w, n)[0], batch[r]), (level, r)
    packed, scale_min = pack_int4(q, scales_zeros)
    with pytest.raises(RuntimeError, match="float32"):
        module.int4_mm(x.bfloat16(), packed, scale_min)
    with pytest.raises(RuntimeError, match="columns"):
        module.int4_mm(x[:, :64], packed, scale_min)
    with pytest.raises(RuntimeError, match="float32"):
        module.int4_gemm(x.bfloat16(), gemm_w, n)
    with pytest.raises(RuntimeError, match="pack_int4_gemm"):
        module.int4_gemm(x[:, :64], gemm_w, n)
    with pytest.raises(RuntimeError, match="pack_int4_gemm"):
        module.int4_gemm(x, gemm_w, n + 8)
