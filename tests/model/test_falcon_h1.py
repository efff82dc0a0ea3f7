"""Falcon-H1 (attention and a Mamba2 mixer side by side in every layer, muP multipliers) over
attention cells + state slots against transformers (a random model, every weight redrawn, every
multiplier away from 1) and llama.cpp (its converter's GGUF, llama-server's logprobs)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from model import load_model
from model.errors import ModelLoadError
from model.kernels import load_kernels
from model.layers.ggml import BlockLinear, has_block_kernels
from model.layers.quant import quantize
from model.runner.native import NativeDecoder
from model.runner.worker import make_worker
from tests.llamacpp_convert import convert_with_llamacpp
from tests.llamacpp_server import assert_same_next_token_logprobs, llama_server_or_skip
from tests.model.state_driver import (
    Chunk,
    StateDriver,
    assert_close,
    check_chunks_mixed_steps_and_captures,
    greedy,
    hf_greedy,
    mixed_steps,
    prompt,
)
from tests.tiny_ssm import write_tiny_falcon_h1

transformers = pytest.importorskip("transformers")
# llama-server's logprobs on the converter's float32 GGUF (its float16 K/V)
LLAMA_CPP_F32 = 0.01
# the three places of the Mamba2 norm: Mamba2's after the gate, norm_before_gate, none
VARIANTS = {
    "after_gate": {},
    "before_gate": {"norm_before_gate": True},
    "none": {"rms_norm": False},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    return request.param


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("falcon_h1")
    return {
        name: write_tiny_falcon_h1(root / name, seed=1, long_memory=True, **kw)
        for name, kw in VARIANTS.items()
    }


@pytest.fixture(scope="module")
def models(folders):
    return {name: load_model(f) for name, f in folders.items()}


@pytest.fixture(scope="module")
def hf_models(folders):
    return {
        name: transformers.AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval()
        for name, f in folders.items()
    }


def driver(model, n_cells: int = 1024, n_slots: int = 8) -> StateDriver:
    worker = make_worker(model, n_cells=n_cells, group_cells=[n_cells, n_slots])
    return StateDriver(worker, n_cells, n_slots)


def test_description_read_from_the_config(models, variant):
    args = models[variant].config
    assert args.mixers == ("attn_mamba2",) * 3
    assert args.ssm is not None and args.ssm.norm == variant
    assert (args.ssm.n_heads, args.ssm.head_dim, args.head_dim) == (8, 12, 24)
    assert [(g.key, g.layers) for g in args.memory_spec.groups] == [
        ("full", (0, 1, 2)),
        ("recurrent", (3, 4, 5)),
    ]
    assert [args.state_layer(i) for i in range(3)] == [3, 4, 5]
    assert args.layer_desc(0).rope is not None and args.embed_mult == 2.0
    block = models[variant].transformer.layers[0]
    assert block.ssm_mixer is not None and (block.ssm_mixer.norm_w is None) == (variant == "none")


@pytest.mark.parametrize("n", [3, 40, 300])
def test_prompt_logits_match_transformers(models, hf_models, variant, n):
    ids = prompt(n, seed=n)
    with torch.inference_mode():
        ref = hf_models[variant](torch.tensor([ids])).logits[0]
    assert_close(driver(models[variant]).logits([Chunk(0, ids, all_rows=True)]), ref)


@pytest.mark.parametrize("n", [5, 200])
def test_greedy_decode_matches_transformers(models, hf_models, n):
    ids = prompt(n, seed=n + 1)
    ref_tokens, ref = hf_greedy(hf_models["after_gate"], ids, 16)
    tokens, ours = greedy(driver(models["after_gate"]), 0, ids, 16)
    assert_close(ours, ref)
    assert tokens == ref_tokens


def test_chunks_mixed_steps_and_captures(models):
    check_chunks_mixed_steps_and_captures(lambda: driver(models["after_gate"]))


def test_mamba2_mix_kernel_computes_each_norm_variant(models, variant):
    """kernels.mamba2_mix with the norm after the gate, before it, or none, against the
    mixer's torch ops on the same states (the Python layers and the one-call step call the
    kernel where it is built)."""
    from kvcache.state_storage import RecurrentStorage
    from model.layers.batch import ForwardBatch, StateBatch, StatePrompt

    kernels = load_kernels()
    if kernels is None or not hasattr(kernels, "mamba2_mix"):
        pytest.skip("no C++ kernels built for this CPU")
    tiny = models[variant]
    mixer = tiny.transformer.layers[1].ssm_mixer
    assert mixer.kernel_takes(kernels)
    args, gen = tiny.config, torch.Generator().manual_seed(0)
    u = torch.randn(12, args.dim, generator=gen)
    sb = StateBatch(torch.tensor([0, 5, 11]), torch.tensor([6, 0, 3]), [StatePrompt(1, 5, 1, [])])
    results = []
    for fused in (None, kernels):
        sb.native = None
        st = RecurrentStorage((3, 4, 5), 8, *args.state_shapes)
        g = torch.Generator().manual_seed(1)
        st.conv(4).copy_(torch.randn(st.conv(4).shape, generator=g))
        st.ssm(4).copy_(torch.randn(st.ssm(4).shape, generator=g) * 0.1)
        batch = ForwardBatch.__new__(ForwardBatch)
        batch.fused, batch.state = fused, sb
        out = mixer(u, batch, type("S", (), {"state": st})(), 4)
        results.append((out, st.conv(4).clone(), st.ssm(4).clone()))
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# each quantization with another place of the Mamba2 norm (a GGUF's: after the gate)
NORM_OF_QUANT = {"int4": "before_gate", "int8": "none", "gguf": "after_gate"}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("quant", list(NORM_OF_QUANT))
def test_the_one_call_step_runs_falcon_h1_as_the_python_layers(
    tmp_path_factory, dtype, quant, monkeypatch
):
    """step.cpp's parallel layer: mamba2_mix through the mixer's own linears beside the
    attention, the sum, then the MLP. Sequences batched together (prompt chunks beside decode
    rows, a fork, a capture mid-chunk resumed by a new sequence): every step in one call, bit
    for bit the Python layers' logits."""
    if load_kernels() is None:
        pytest.skip("no C++ kernels built for this CPU")
    where = tmp_path_factory.mktemp("falcon_h1") / "hf"
    kw = VARIANTS[NORM_OF_QUANT[quant]]
    path = write_tiny_falcon_h1(
        where, dim=128, head_dim=32, hidden_dim=256, mamba_heads=4, mamba_head_dim=32,
        seed=3, long_memory=True, **kw,
    )  # fmt: skip
    if quant == "gguf":  # an F16 file's own blocks (BlockLinear), the mixers' projections too
        if not has_block_kernels(load_kernels()):
            pytest.skip("a build without ggml_linear")
        f16 = convert_with_llamacpp(path, where.parent / "f16.gguf", "f16")
        loaded = load_model(f16, dtype=dtype, blocks=True)
        assert isinstance(loaded.transformer.layers[0].ssm_mixer.in_proj, BlockLinear)
    else:
        loaded = load_model(path, dtype=dtype)
        quantize(loaded.transformer, quant)
    worker = make_worker(loaded, n_cells=512, group_cells=[512, 8])
    assert worker.paths.native is not None, worker.paths.describe()
    calls: list[int] = []
    layers = NativeDecoder.layers
    monkeypatch.setattr(NativeDecoder, "layers", lambda *a: calls.append(1) or layers(*a))
    native = mixed_steps(worker, (3, 30, 9, 70, 20))
    assert len(calls) == 4 + (3 if worker.paths.prompt_attention is not None else 0)
    worker.paths.native = None
    assert torch.equal(native, mixed_steps(worker, (3, 30, 9, 70, 20)))


def test_a_clamped_time_step_is_refused(folders, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folders["none"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    config["time_step_limit"] = [0.001, 100.0]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="time_step_limit"):
        load_model(bad)


def test_llamacpp_gguf_and_llama_server(folders, models, hf_models, tmp_path):
    """llama.cpp's converter (FalconH1Model: the multipliers folded into the weights, ffn_norm
    without ".weight") writes a GGUF that loads as the folder's model and gives transformers'
    logits; a Q8_0 file runs on its own blocks; llama-server's next-token logprobs on the
    float32 file are ours (the norm after the gate: llama.cpp's only place for it)."""
    path = convert_with_llamacpp(folders["after_gate"], tmp_path / "f32.gguf")
    loaded = load_model(path)
    a, b = loaded.config, models["after_gate"].config
    assert (a.mixers, a.n_heads, a.n_kv_heads, a.head_dim) == (
        b.mixers,
        b.n_heads,
        b.n_kv_heads,
        b.head_dim,
    )
    assert a.ssm is not None and b.ssm is not None
    assert replace(a.ssm, norm_eps=b.ssm.norm_eps) == b.ssm  # the file's eps is a float32
    assert a.mup is None and a.embed_mult == 1.0  # the converter folded the multipliers
    ids = prompt(120, seed=1)
    with torch.inference_mode():
        ref = hf_models["after_gate"](torch.tensor([ids])).logits[0]
    ours = driver(loaded).logits([Chunk(0, ids, all_rows=True)])
    assert_close(ours, ref)
    if has_block_kernels(load_kernels()):
        q8 = convert_with_llamacpp(folders["after_gate"], tmp_path / "q8.gguf", "q8_0")
        blocks = load_model(q8, blocks=True)
        assert isinstance(blocks.transformer.layers[1].mixer.wqkv, BlockLinear)
        got = driver(blocks).logits([Chunk(0, ids)])[0]
        assert float((got - ours[-1]).abs().max()) < 0.05 * float(ours[-1].max() - ours[-1].min())
    binary = llama_server_or_skip()
    prompts = [prompt(5 + 7 * seed, seed=30 + seed) for seed in range(6)]
    assert_same_next_token_logprobs(
        binary, path, tmp_path / "llama.log", prompts,
        lambda _, ids: driver(loaded, n_cells=64).logits([Chunk(0, ids)])[0],
        LLAMA_CPP_F32, least=4,
    )  # fmt: skip


def test_a_tied_head_reads_the_unscaled_embedding_table(tmp_path):
    """tie_word_embeddings: the head is the embedding table as stored (embedding_multiplier
    scales the inputs, lm_head_multiplier the logits), as transformers computes it. llama.cpp's
    converter folds embedding_multiplier into token_embd and writes no output tensor for a tied
    model, so its GGUF's head is the scaled table without lm_head_multiplier: logits
    embedding_multiplier / lm_head_multiplier (4) times transformers'. The GGUF is read as
    llama.cpp reads it (llama-server's logprobs on it are ours)."""
    folder = write_tiny_falcon_h1(tmp_path / "tied", seed=2, long_memory=True, tied=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    model = load_model(folder)
    ids = prompt(60, seed=3)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert_close(driver(model).logits([Chunk(0, ids, all_rows=True)]), ref)
    path = convert_with_llamacpp(folder, tmp_path / "tied.gguf")
    loaded = load_model(path)
    assert_close(driver(loaded).logits([Chunk(0, ids, all_rows=True)]), ref * 4.0)
    binary = llama_server_or_skip()
    prompts = [prompt(5 + 9 * seed, seed=40 + seed) for seed in range(4)]
    assert_same_next_token_logprobs(
        binary, path, tmp_path / "llama.log", prompts,
        lambda _, ids: driver(loaded, n_cells=64).logits([Chunk(0, ids)])[0],
        4 * LLAMA_CPP_F32, least=3,  # logits 4x as spread: its float16 K/V errors 4x as large
    )  # fmt: skip
