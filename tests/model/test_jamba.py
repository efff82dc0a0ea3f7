"""Jamba (Mamba mixers with weighted dt / B / C norms, NoPE attention layers, experts on every
other layer) over attention cells + state slots against transformers (a random model, every
weight redrawn) and llama.cpp (its converter's GGUF, llama-server's logprobs)."""

from __future__ import annotations

import json

import pytest
import torch

from model import load_model
from model.errors import ModelLoadError
from model.kernels import load_kernels
from model.layers.ggml import BlockLinear, has_block_kernels
from model.layers.moe import MoEFeedForward
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
    prompt,
)
from tests.tiny_ssm import write_tiny_jamba

transformers = pytest.importorskip("transformers")
# llama-server's logprobs on the converter's float32 GGUF: measured worst 0.0019 (its float16 K/V)
LLAMA_CPP_F32 = 0.01
JAMBA_BPE = "conversion.jamba:JambaModel"  # its converter writes the tiny BPE as GPT-2's


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_jamba(tmp_path_factory.mktemp("jamba") / "tiny", seed=1, long_memory=True)


@pytest.fixture(scope="module")
def tiny(folder):
    return load_model(folder)


@pytest.fixture(scope="module")
def hf_tiny(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def driver(model, n_cells: int = 1024, n_slots: int = 8) -> StateDriver:
    worker = make_worker(model, n_cells=n_cells, group_cells=[n_cells, n_slots])
    return StateDriver(worker, n_cells, n_slots)


def test_description_read_from_the_config(tiny):
    args = tiny.config
    assert args.mixers == ("mamba", "attn", "mamba", "mamba", "attn")
    assert args.moe_layers == (False, True, False, True, False)
    assert args.moe is not None and not args.moe.norm_topk_prob
    assert (args.moe.n_experts, args.moe.n_used, args.moe.expert_dim) == (4, 2, 96)
    assert args.mamba is not None and args.mamba.dt_b_c_norm == "weighted"
    assert args.layer_desc(1).rope is None  # no position encoding
    assert [g.key for g in args.memory_spec.groups] == ["full", "recurrent"]
    layers = tiny.transformer.layers
    assert isinstance(layers[1].feed_forward, MoEFeedForward)
    assert not isinstance(layers[0].feed_forward, MoEFeedForward)


@pytest.mark.parametrize("n", [3, 40, 500])
def test_prompt_logits_match_transformers(tiny, hf_tiny, n):
    ids = prompt(n, seed=n)
    with torch.inference_mode():
        ref = hf_tiny(torch.tensor([ids])).logits[0]
    assert_close(driver(tiny).logits([Chunk(0, ids, all_rows=True)]), ref)


@pytest.mark.parametrize("n", [5, 200])
def test_greedy_decode_matches_transformers(tiny, hf_tiny, n):
    ids = prompt(n, seed=n + 1)
    ref_tokens, ref = hf_greedy(hf_tiny, ids, 16)
    tokens, ours = greedy(driver(tiny), 0, ids, 16)
    assert_close(ours, ref)
    assert tokens == ref_tokens


def test_chunks_mixed_steps_and_captures(tiny):
    check_chunks_mixed_steps_and_captures(lambda: driver(tiny))


def test_a_dense_mlp_kept_as_the_only_expert_loads(folder, tiny, tmp_path):
    """AI21's first checkpoints store a dense layer's MLP as feed_forward.experts.0.*."""
    from safetensors.torch import load_file, save_file

    moved = tmp_path / "old"
    moved.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (moved / f.name).write_bytes(f.read_bytes())
    (src,) = folder.glob("*.safetensors")
    raw = load_file(src)
    for name in [k for k in raw if ".feed_forward." in k and ".experts." not in k]:
        if "router" not in name:
            raw[name.replace(".feed_forward.", ".feed_forward.experts.0.")] = raw.pop(name)
    save_file(raw, moved / src.name)
    ids = prompt(30, seed=9)
    want = driver(tiny).logits([Chunk(0, ids)])
    assert_close(driver(load_model(moved)).logits([Chunk(0, ids)]), want)


def test_a_config_without_attention_offsets_is_refused(folder, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    del config["attn_layer_period"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="attn_layer_period"):
        load_model(bad)


def test_llamacpp_gguf_and_llama_server(folder, tiny, hf_tiny, tmp_path):
    """llama.cpp's converter (JambaModel: head_count_kv 0 on Mamba layers, experts stacked into
    ffn_*_exps on the expert layers, A = -exp(A_log)) writes a GGUF that loads as the folder's
    model and gives transformers' logits; a Q8_0 file runs on its own blocks; llama-server's
    next-token logprobs on the float32 file are ours."""
    path = convert_with_llamacpp(folder, tmp_path / "f32.gguf", bpe_for=JAMBA_BPE)
    loaded = load_model(path)
    a, b = loaded.config, tiny.config
    assert (a.mixers, a.moe, a.moe_layers, a.nope) == (b.mixers, b.moe, b.moe_layers, b.nope)
    ids = prompt(120, seed=1)
    with torch.inference_mode():
        ref = hf_tiny(torch.tensor([ids])).logits[0]
    ours = driver(loaded).logits([Chunk(0, ids, all_rows=True)])
    assert_close(ours, ref)
    if has_block_kernels(load_kernels()):
        q8 = convert_with_llamacpp(folder, tmp_path / "q8.gguf", "q8_0", bpe_for=JAMBA_BPE)
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
