"""Mamba2 and Granite 4.0-H (granitehybrid) GGUFs: model/load/hf_to_gguf.py converts the HF
folder, model/load/gguf.py reads it back into exactly the HF model's sizes and weights, and the
GGUF model computes the HF folder's logits (the tiny models: ssm_gguf.py; llama.cpp's layout of
the file: test_gguf_ssm_layout.py; what cannot load: test_gguf_ssm_refusals.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcache.rope import RopeConfig
from model.arch import ModelArgs, SSMArgs
from model.load.gguf import open_gguf
from model.load.hf_to_gguf import NOPE_CONTEXT, convert
from tests.model.ssm_gguf import (
    GRANITE,
    MAMBA2,
    assert_same_weights,
    f32,
    ggml_shapes,
    hf_state,
    load_gguf,
    make_granite,
    make_mamba2,
    ssm_weights,
)
from tests.tiny_models import write_tiny_llama

transformers = pytest.importorskip("transformers")


# ---- Mamba2 ----


def test_mamba2_gguf_round_trips_every_size_and_weight(mamba2_dir, tmp_path):
    path = convert(mamba2_dir, tmp_path / "m.gguf")
    args, weights = load_gguf(path)
    c = MAMBA2
    assert args == ModelArgs(
        arch="mamba2",
        vocab_size=2048,
        dim=64,
        n_layers=3,
        n_heads=0,
        n_kv_heads=0,
        head_dim=0,
        hidden_dim=0,
        norm_eps=f32(1e-5),
        rope=RopeConfig(10000.0, 0, "neox"),
        n_ctx_train=NOPE_CONTEXT,
        mixers=("mamba2",) * 3,
        ssm=SSMArgs(
            n_heads=c["num_heads"],
            head_dim=c["head_dim"],
            d_state=c["state_size"],
            n_groups=c["n_groups"],
            d_conv=c["conv_kernel"],
            conv_bias=True,
            proj_bias=False,
            norm_eps=f32(1e-5),
        ),
        ffn=False,
    )
    sd = hf_state(mamba2_dir)
    want = {
        "tok_embeddings": sd["backbone.embeddings.weight"],
        "norm": sd["backbone.norm_f.weight"],
        "output": sd["lm_head.weight"],
    }
    for i in range(3):
        want[f"layers.{i}.attn_norm"] = sd[f"backbone.layers.{i}.norm.weight"]
        mixer = ssm_weights(sd, f"backbone.layers.{i}.mixer.")
        want |= {f"layers.{i}.{k}": v for k, v in mixer.items()}
    assert_same_weights(weights, want)
    assert not torch.equal(weights["output"], weights["tok_embeddings"])


# ---- Granite 4.0-H ----


def test_granite_gguf_round_trips_every_size_and_weight(granite_case, tmp_path):
    folder, layer_types, rope = granite_case
    args, weights = load_gguf(convert(folder, tmp_path / "g.gguf"))
    c = GRANITE
    mixers = tuple("attn" if t == "attention" else "mamba2" for t in layer_types)
    assert args == ModelArgs(
        arch="granitehybrid",
        vocab_size=2048,
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=c["shared_intermediate_size"],
        norm_eps=f32(1e-6),
        rope=RopeConfig(10000.0, 16, "neox"),
        n_ctx_train=2048 if rope else NOPE_CONTEXT,
        attn_scale=0.25,
        mixers=mixers,
        ssm=SSMArgs(n_heads=8, head_dim=16, d_state=16, n_groups=2, d_conv=4, norm_eps=f32(1e-6)),
        ffn=True,
        nope=not rope,
        embed_mult=2.0,
        residual_mult=0.5,
        logits_scaling=4.0,
    )
    sd = hf_state(folder)
    f = c["shared_intermediate_size"]
    want = {
        "tok_embeddings": sd["model.embed_tokens.weight"],
        "norm": sd["model.norm.weight"],
        "output": sd["lm_head.weight"],
    }
    for i, kind in enumerate(layer_types):
        p = f"model.layers.{i}."
        gate_up = sd[p + "shared_mlp.input_linear.weight"]
        layer = {
            "attn_norm": sd[p + "input_layernorm.weight"],
            "ffn_norm": sd[p + "post_attention_layernorm.weight"],
            "w1": gate_up[:f],
            "w3": gate_up[f:],
            "w2": sd[p + "shared_mlp.output_linear.weight"],
        }
        if kind == "mamba":
            layer |= ssm_weights(sd, p + "mamba.")
        else:
            for ours, proj in (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o")):
                layer[ours] = sd[f"{p}self_attn.{proj}_proj.weight"]
        want |= {f"layers.{i}.{k}": v for k, v in layer.items()}
    assert_same_weights(weights, want)


def test_tied_granite_has_no_output_tensor(tmp_path):
    folder = make_granite(
        tmp_path / "hf",
        ["mamba", "attention"],
        False,
        num_hidden_layers=2,
        tie_word_embeddings=True,
    )
    path = convert(folder, tmp_path / "t.gguf")
    assert "output.weight" not in ggml_shapes(open_gguf(path))
    _, weights = load_gguf(path)
    sd = hf_state(folder)
    assert torch.equal(weights["output"], sd["model.embed_tokens.weight"])
    assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])


def test_conv_without_bias(tmp_path):
    """llama.cpp's mamba2 requires ssm_conv1d.bias (the converter writes zeros), its
    granitehybrid makes it optional (left out, and conv_bias is False)."""
    mamba2 = make_mamba2(tmp_path / "m", use_conv_bias=False, num_hidden_layers=1)
    args, weights = load_gguf(convert(mamba2, tmp_path / "m.gguf"))
    assert args.ssm is not None and args.ssm.conv_bias
    assert torch.equal(weights["layers.0.ssm_conv_b"], torch.zeros(192))
    granite = make_granite(
        tmp_path / "g", ["mamba", "attention"], False, num_hidden_layers=2, mamba_conv_bias=False
    )
    path = convert(granite, tmp_path / "g.gguf")
    assert "blk.0.ssm_conv1d.bias" not in ggml_shapes(open_gguf(path))
    args, weights = load_gguf(path)
    assert args.ssm is not None and not args.ssm.conv_bias
    assert "layers.0.ssm_conv_b" not in weights


def test_converter_command_line(mamba2_dir, tmp_path, capsys):
    from model.load.hf_to_gguf import main

    main([str(mamba2_dir), str(tmp_path / "cli.gguf"), "--outtype", "f16"])
    assert "wrote" in capsys.readouterr().out
    assert load_gguf(tmp_path / "cli.gguf")[0].arch == "mamba2"
    with pytest.raises(SystemExit, match="model_type 'llama' cannot be converted"):
        main([str(write_tiny_llama(tmp_path / "llama")), str(tmp_path / "x.gguf")])


# ---- the GGUF model runs like the HF folder's ----


def run_greedy(path: Path, prompt: list[int], n_decode: int) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logits (every row) and the logits of `n_decode` greedy decode steps,
    one per forward, on a fresh worker."""
    from model.load.loader import load_model
    from model.runner.worker import make_worker
    from tests.model.state_driver import Chunk, StateDriver

    driver = StateDriver(make_worker(load_model(path), n_cells=64), n_cells=64, n_slots=2)
    rows = [driver.logits([Chunk(0, prompt, all_rows=True)])]
    tokens = []
    for _ in range(n_decode):
        tokens.append(int(rows[-1][-1].argmax()))
        rows.append(driver.logits([Chunk(0, tokens[-1:])]))
    return torch.cat(rows), tokens


@pytest.mark.parametrize(
    "kind", ["mamba2", "mamba2-no-conv-bias", "granite-nope-tied", "granite-rope"]
)
def test_gguf_model_computes_the_hf_folders_logits(kind, tmp_path):
    from model.load.loader import load_model
    from tests.tiny_ssm import write_tiny_granite_hybrid, write_tiny_mamba2

    if kind.startswith("mamba2"):
        folder = write_tiny_mamba2(tmp_path / "hf", conv_bias=not kind.endswith("conv-bias"))
    else:
        folder = write_tiny_granite_hybrid(
            tmp_path / "hf", rope=kind.endswith("rope"), tie=kind.endswith("tied")
        )
    path = convert(folder, tmp_path / "m.gguf")
    hf_tok, gguf_tok = load_model(folder).tokenizer, load_model(path).tokenizer
    prompt = hf_tok.encode("Hello world! How are you today? I am a tiny language model.")
    assert gguf_tok.encode(gguf_tok.decode(prompt)) == prompt
    want, want_tokens = run_greedy(folder, prompt, 4)
    got, got_tokens = run_greedy(path, prompt, 4)
    assert got.shape == (len(prompt) + 4, 2048)
    assert float((got - want).abs().max()) < 1e-5 * float(want.abs().max())
    assert got_tokens == want_tokens
