"""Mamba2 and Granite 4.0-H (granitehybrid) GGUFs: model/load/hf_to_gguf.py writes llama.cpp's
layout, model/load/gguf.py reads it back into exactly the HF model's sizes and weights (the tiny
models: ssm_gguf.py; what cannot load: test_gguf_ssm_refusals.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from kvcache.rope import RopeConfig
from model.arch import ModelArgs, SSMArgs
from model.load.gguf import open_gguf
from model.load.gguf_file import GGUFFile
from model.load.hf_to_gguf import NOPE_CONTEXT, convert
from tests.model.ssm_gguf import (
    GRANITE,
    MAMBA2,
    assert_same_weights,
    f32,
    hf_state,
    load_gguf,
    make_granite,
    make_mamba2,
    ssm_weights,
)
from tests.tiny_models import write_tiny_llama

transformers = pytest.importorskip("transformers")


# ---- Mamba2 ----


@pytest.fixture(scope="module")
def mamba2_dir(tmp_path_factory) -> Path:
    return make_mamba2(tmp_path_factory.mktemp("mamba2") / "hf")


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


def ggml_shapes(reader: GGUFFile) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}


def expected_llama_cpp_tensors(
    n_layers: int, recurrent: list[bool], ffn: bool, output: bool
) -> dict[str, tuple[int, ...]]:
    """llama-model.cpp's create_tensor shapes (ggml order) for these sizes: n_embd 64, vocab
    2048, d_inner 128, N 16, G 2, H 8, K 4; attention 4 heads x 16, 2 kv heads; n_ff 128."""
    e, d_inner, n_state, groups, heads, k, ff = 64, 128, 16, 2, 8, 4, 128
    conv_dim = d_inner + 2 * groups * n_state
    shapes = {"token_embd.weight": (e, 2048), "output_norm.weight": (e,)}
    if output:
        shapes["output.weight"] = (e, 2048)
    for i in range(n_layers):
        b = f"blk.{i}."
        shapes[b + "attn_norm.weight"] = (e,)
        if recurrent[i]:
            shapes |= {
                b + "ssm_in.weight": (e, 2 * d_inner + 2 * groups * n_state + heads),
                b + "ssm_conv1d.weight": (k, conv_dim),
                b + "ssm_conv1d.bias": (conv_dim,),
                b + "ssm_dt.bias": (heads,),
                b + "ssm_a": (1, heads),
                b + "ssm_d": (1, heads),
                b + "ssm_norm.weight": (d_inner // groups, groups),
                b + "ssm_out.weight": (d_inner, e),
            }
        else:
            shapes |= {
                b + "attn_q.weight": (e, 64),
                b + "attn_k.weight": (e, 32),
                b + "attn_v.weight": (e, 32),
                b + "attn_output.weight": (64, e),
            }
        if ffn:
            shapes |= {
                b + "ffn_norm.weight": (e,),
                b + "ffn_gate.weight": (e, ff),
                b + "ffn_up.weight": (e, ff),
                b + "ffn_down.weight": (ff, e),
            }
    return shapes


def gguf_tensor_kinds(arch: gguf.MODEL_ARCH) -> set[str]:
    return {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}


def base_name(name: str) -> str:
    return re.sub(r"^blk\.\d+\.", "blk.{bid}.", name.removesuffix(".weight").removesuffix(".bias"))


def kv(reader: GGUFFile) -> dict[str, Any]:
    return dict(reader.fields)


def test_mamba2_gguf_has_llama_cpp_keys_and_tensors(mamba2_dir, tmp_path):
    reader = open_gguf(convert(mamba2_dir, tmp_path / "m.gguf"))
    assert {base_name(n) for n in ggml_shapes(reader)} <= gguf_tensor_kinds(gguf.MODEL_ARCH.MAMBA2)
    assert ggml_shapes(reader) == expected_llama_cpp_tensors(3, [True] * 3, False, True)
    meta = kv(reader)
    assert meta["general.architecture"] == "mamba2"
    assert {k: v for k, v in meta.items() if k.startswith("mamba2.")} == {
        "mamba2.block_count": 3,
        "mamba2.context_length": NOPE_CONTEXT,
        "mamba2.embedding_length": 64,
        "mamba2.feed_forward_length": 0,
        "mamba2.attention.head_count": 0,
        "mamba2.attention.layer_norm_rms_epsilon": pytest.approx(1e-5),
        "mamba2.ssm.conv_kernel": 4,
        "mamba2.ssm.inner_size": 128,
        "mamba2.ssm.state_size": 16,
        "mamba2.ssm.time_step_rank": 8,  # the head count, not HF's time_step_rank (4)
        "mamba2.ssm.group_count": 2,
    }
    assert meta["general.file_type"] == gguf.LlamaFileType.ALL_F32
    # llama.cpp needs one token per embedding row: the 320-token vocab is padded
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == 2048 and tokens[-1] == "[PAD2047]" and types[-1] == 5
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.merges"]
    assert tokens[meta["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert types[tokens.index("<|im_start|>")] == 3


def test_f16_gguf_keeps_small_tensors_in_f32(mamba2_dir, tmp_path):
    path = convert(mamba2_dir, tmp_path / "m16.gguf", outtype="f16")
    reader = open_gguf(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ssm_in.weight"] == types["token_embd.weight"] == "F16"
    assert types["blk.0.ssm_norm.weight"] == "F16"  # 2-D [G, d_inner/G], as llama.cpp's
    for name in ("ssm_conv1d.weight", "ssm_conv1d.bias", "ssm_a", "ssm_d", "attn_norm.weight"):
        assert types[f"blk.0.{name}"] == "F32", name
    args, weights = load_gguf(path)
    sd = hf_state(mamba2_dir)
    w = sd["backbone.layers.1.mixer.in_proj.weight"]
    assert torch.equal(weights["layers.1.ssm_in"], w.half().float())
    assert torch.equal(weights["layers.1.ssm_conv_b"], sd["backbone.layers.1.mixer.conv1d.bias"])


# ---- Granite 4.0-H ----


GRANITE_CASES = {
    "nope-mamba-first": (["mamba", "attention", "mamba", "attention"], False),
    "rope-attention-first": (["attention", "mamba", "mamba", "attention"], True),
}


@pytest.fixture(scope="module", params=sorted(GRANITE_CASES))
def granite_case(request, tmp_path_factory) -> tuple[Path, list[str], bool]:
    layer_types, rope = GRANITE_CASES[request.param]
    folder = make_granite(tmp_path_factory.mktemp(request.param) / "hf", layer_types, rope)
    return folder, layer_types, rope


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


def test_granite_gguf_has_llama_cpp_keys_and_tensors(granite_case, tmp_path):
    folder, layer_types, rope = granite_case
    reader = open_gguf(convert(folder, tmp_path / "g.gguf"))
    kinds = gguf_tensor_kinds(gguf.MODEL_ARCH.GRANITE_HYBRID)
    assert {base_name(n) for n in ggml_shapes(reader)} <= kinds
    recurrent = [t == "mamba" for t in layer_types]
    assert ggml_shapes(reader) == expected_llama_cpp_tensors(4, recurrent, True, True)
    meta = {k: v for k, v in kv(reader).items() if k.startswith("granitehybrid.")}
    approx = pytest.approx
    assert meta == {
        "granitehybrid.block_count": 4,
        "granitehybrid.vocab_size": 2048,
        "granitehybrid.context_length": 2048 if rope else NOPE_CONTEXT,
        "granitehybrid.embedding_length": 64,
        "granitehybrid.feed_forward_length": 128,
        "granitehybrid.expert_shared_feed_forward_length": 128,
        "granitehybrid.expert_count": 0,
        "granitehybrid.attention.head_count": 4,
        "granitehybrid.attention.head_count_kv": [0 if r else 2 for r in recurrent],
        "granitehybrid.attention.layer_norm_rms_epsilon": approx(1e-6),
        "granitehybrid.attention.scale": 0.25,
        "granitehybrid.embedding_scale": 2.0,
        "granitehybrid.residual_scale": 0.5,
        "granitehybrid.logit_scale": 4.0,
        "granitehybrid.rope.dimension_count": 16,
        "granitehybrid.rope.freq_base": 10000.0,
        "granitehybrid.rope.scaling.finetuned": rope,
        "granitehybrid.ssm.conv_kernel": 4,
        "granitehybrid.ssm.inner_size": 128,
        "granitehybrid.ssm.state_size": 16,
        "granitehybrid.ssm.time_step_rank": 8,
        "granitehybrid.ssm.group_count": 2,
    }


def test_granite_q_and_k_are_stored_llama_permuted(granite_case, tmp_path):
    """llama.cpp rotates interleaved pairs: its converter permutes the q/k rows (undo_permute)."""
    folder, layer_types, _ = granite_case
    reader = open_gguf(convert(folder, tmp_path / "g.gguf"))
    i = layer_types.index("attention")
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}[f"blk.{i}.attn_k.weight"]
    hf = hf_state(folder)[f"model.layers.{i}.self_attn.k_proj.weight"].numpy()
    # head 0's rows in HF order are [x0..x7 | y0..y7]; llama.cpp's are x0 y0 x1 y1 ...
    np.testing.assert_array_equal(stored[0:16:2], hf[0:8])
    np.testing.assert_array_equal(stored[1:16:2], hf[8:16])


def test_published_granite_layer_names_convert_alike(granite_case, tmp_path):
    """Released Granite 4.0-H configs say "mamba"/"attention" (transformers 5 saves
    "linear_attention"/"full_attention")."""
    folder, layer_types, _ = granite_case
    config = json.loads((folder / "config.json").read_text())
    assert config["layer_types"] != layer_types
    config["layer_types"] = layer_types
    legacy = tmp_path / "legacy"
    shutil.copytree(folder, legacy)
    (legacy / "config.json").write_text(json.dumps(config))
    a = open_gguf(convert(folder, tmp_path / "a.gguf"))
    b = open_gguf(convert(legacy, tmp_path / "b.gguf"))
    assert kv(a) == kv(b)
    assert a.fields["granitehybrid.attention.head_count_kv"] == [
        2 if t == "attention" else 0 for t in layer_types
    ]


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
