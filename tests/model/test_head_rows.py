"""A draft model's reduced vocabulary (Transformer.keep_head_rows, `--draft-vocab`): the output
head keeps its first n rows, and its logits are the whole head's first n columns, bit for bit,
on every kind of head (dense, quantized at load, a GGUF's own blocks, repacked or not)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.layers.ggml import GGML_TYPES, BlockLinear, BlockWeight
from model.serving import open_model
from tests.model.factories import require_kernels
from tests.model.test_ggml_blocks import make_weights
from tests.tiny_models import write_tiny_llama


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_the_heads_rows_and_the_ids_a_step_names(tmp_path, quant):
    if quant != "none":
        require_kernels()
    folder = write_tiny_llama(tmp_path / "m")
    full = open_model(folder, "cpu", dtype="float32", quant=quant).loaded.transformer
    vocab = full.args.vocab_size
    n = vocab // 2 + 3
    part = open_model(folder, "cpu", "float32", quant, head_rows=n).loaded.transformer
    hidden = torch.randn(5, full.args.dim, generator=torch.Generator().manual_seed(0))
    want = full.logits(hidden)
    got = part.logits(hidden)
    assert got.shape == (5, vocab) and torch.equal(got[:, :n], want[:, :n])
    assert torch.all(got[:, n:] == float("-inf"))
    # ids a step names: above the rows (repeated, unsorted), below them (scored anyway), past
    # the vocabulary (ignored)
    named = torch.tensor([vocab - 1, n + 5, n, n + 5, 2, vocab + 7])
    got = part.logits(hidden, named)
    extra = [n, n + 5, vocab - 1]
    assert torch.equal(got[:, :n], want[:, :n])
    # those come from the weight as loaded (a quantized head's: the dense one), a few rows
    # at a time (another summation order than the whole matrix's)
    dense = open_model(folder, "cpu", "float32", "none").loaded.transformer.logits(hidden)
    torch.testing.assert_close(got[:, extra], dense[:, extra], rtol=1e-5, atol=1e-5)
    scored = torch.zeros(vocab, dtype=torch.bool)
    scored[:n] = True
    scored[extra] = True
    assert torch.all(got[:, ~scored] == float("-inf"))
    assert torch.equal(part.logits(hidden, torch.tensor([1, 2])), part.logits(hidden))
    # the draft still reads every token: the embedding table is whole
    ids = torch.tensor([0, n, vocab - 1])
    assert torch.equal(part.embed(ids), full.embed(ids))
    same = open_model(folder, "cpu", "float32", quant, head_rows=vocab).loaded.transformer
    assert torch.equal(same.logits(hidden), want)  # the whole vocabulary: nothing kept out
    with pytest.raises(ValueError, match="vocabulary has"):
        part.keep_head_rows(vocab + 1)


def test_a_gguf_head_scores_named_ids_from_the_files_rows():
    """A reduced GGUF head (the rows repacked or not) scores the ids a step names from the
    file's own rows: the same logits as the whole head's."""
    from model.layers.decoder import ReducedHead

    kern = require_kernels()
    rng = np.random.default_rng(2)
    k = 256
    for name in ("Q8_0", "Q4_K"):
        data = torch.from_numpy(make_weights(name, 64, k, rng))
        w = BlockWeight(data, GGML_TYPES[name], (64, k), "output", mapped=False)
        bias = torch.from_numpy(rng.standard_normal(64).astype(np.float32))
        whole = BlockLinear([w], bias, kern)
        head = ReducedHead(whole, 32)
        x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
        out, ids = head.scored(x, torch.tensor([40, 33, 5, 40, 63]))
        assert ids.tolist() == [33, 40, 63]
        want = whole(x)
        assert torch.equal(out[:, :32], want[:, :32]), name
        assert torch.equal(out[:, 32:], want[:, [33, 40, 63]]), name


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K", "Q5_0"])
def test_a_gguf_heads_first_rows_on_its_own_blocks(name):
    kern = require_kernels()
    rng = np.random.default_rng(1)
    k = 256
    data = torch.from_numpy(make_weights(name, 64, k, rng))
    w = BlockWeight(data, GGML_TYPES[name], (64, k), "output", mapped=False)
    full = BlockLinear([w], None, kern)
    for n in (16, 40):  # a whole repack group, and not (the file's layout then)
        part = full.first_rows(n)
        assert part.out_features == n and part.nbytes == data[:n].numel()
        if part.types[0] == GGML_TYPES[name]:  # not repacked: a view of the file's rows
            assert part.parts[0].data_ptr() == data.data_ptr()
        for m in (1, 7, 33):
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            for dtype in (torch.float32, torch.bfloat16):
                assert torch.equal(part(x.to(dtype)), full(x.to(dtype))[:, :n]), (n, m, dtype)
    for bad in (0, 65):
        with pytest.raises(ValueError, match="first_rows"):
            full.first_rows(bad)
    with pytest.raises(ValueError, match="fused"):
        BlockLinear([w, w], None, kern).first_rows(8)
