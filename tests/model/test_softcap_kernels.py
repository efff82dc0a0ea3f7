"""model/kernels: Gemma 2's attention logit soft-capping in the C++ attention kernels,
tanh(s / cap) * cap on the scaled scores before the softmax, against a float64 reference: the
decode kernel (float32 and bfloat16; head_dim 64 takes the AVX2 / AVX-512 BF16 loops where the
build has them, 48 the generic loop) and the prompt kernel, on the build the dispatcher picks
(CELLSERVE_ISA chooses another)."""

from __future__ import annotations

import pytest
import torch

from model.kernels import isa
from tests.model.factories import require_kernels

CAP = 2.0  # small against the scores below: the cap bends most of them


def reference(q, k, v, cells, lens, scale, softcap):
    """Per sequence: its first lens[s] cells, GQA by repeated kv heads, float64, scores capped
    as transformers' Gemma 2 eager attention caps them where softcap > 0."""
    group = q.shape[1] // k.shape[0]
    out = []
    for s in range(q.shape[0]):
        idx = cells[s, : lens[s]]
        ks = k[:, idx].double().repeat_interleave(group, dim=0)  # [n_heads, n, hd]
        vs = v[:, idx].double().repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hnd->hn", q[s].double() * scale, ks)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out.append(torch.einsum("hn,hnd->hd", torch.softmax(scores, dim=-1), vs))
    return torch.stack(out)


def make_inputs(dtype, n_heads, n_kv, hd, seed):
    gen = torch.Generator().manual_seed(seed)
    n_cells = 120
    k = torch.randn(n_kv, n_cells, hd, generator=gen).to(dtype)
    v = torch.randn(n_kv, n_cells, hd, generator=gen).to(dtype)
    q = (3 * torch.randn(5, n_heads, hd, generator=gen)).to(dtype)  # scores of several CAPs
    lens = torch.tensor([1, 16, 17, 50, 97])
    cells = torch.stack([torch.randperm(n_cells, generator=gen)[:97] for _ in lens])
    return q, k, v, cells, lens


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n_heads, n_kv, hd", [(8, 2, 64), (6, 3, 48)])
def test_decode_attention_caps_the_scores(dtype, tol, n_heads, n_kv, hd):
    kernel = require_kernels().decode_attention
    q, k, v, cells, lens = make_inputs(dtype, n_heads, n_kv, hd, seed=7)
    scale = hd**-0.5
    got = kernel(q, k, v, cells, lens, scale, CAP)
    want = reference(q, k, v, cells, lens, scale, CAP)
    assert float((got.double() - want).abs().max()) < tol
    # the cap changes the output well past the tolerance, and softcap 0 is no cap
    uncapped = reference(q, k, v, cells, lens, scale, 0.0)
    assert float((uncapped - want).abs().max()) > 10 * tol
    assert float((kernel(q, k, v, cells, lens, scale).double() - uncapped).abs().max()) < tol
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        kernel(q, k, v, cells, lens, scale, -1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_attention_caps_the_scores(dtype):
    module = require_kernels()
    if not (module.has_f32_kernels() if dtype == torch.float32 else module.has_bf16_kernels()):
        pytest.skip(f"no {dtype} prompt kernel at ISA level {isa.active_level()}")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    gen = torch.Generator().manual_seed(8)
    n_heads, n_kv, hd, n_cells, past, L = 8, 2, 64, 100, 13, 29
    k = torch.randn(n_kv, n_cells, hd, generator=gen).to(dtype)
    v = torch.randn(n_kv, n_cells, hd, generator=gen).to(dtype)
    q = (3 * torch.randn(L, n_heads, hd, generator=gen)).to(dtype)
    cells = torch.randperm(n_cells, generator=gen)[: past + L]
    lens = torch.arange(past + 1, past + L + 1)
    scale = hd**-0.5
    got = module.prompt_attention(q, k, v, cells, lens, scale, CAP)
    want = reference(q, k, v, cells.expand(L, -1), lens, scale, CAP)
    assert float((got.double() - want).abs().max()) < tol
    uncapped = reference(q, k, v, cells.expand(L, -1), lens, scale, 0.0)
    assert float((uncapped - want).abs().max()) > 10 * tol
