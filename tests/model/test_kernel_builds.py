"""model/kernels, every ISA level's build (model/kernels/isa.py): the dispatcher's choice, each
build's instructions within its level, the reference values (test_kernels.py's) and the torch
path's logits from each, its int4 kernels, and the portable build."""

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
from tests.model.test_kernels import reference
from tests.tiny_models import write_tiny_llama


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
