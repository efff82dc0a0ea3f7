"""Mamba2 and Granite 4.0-H GGUFs as llama.cpp reads them: model/load/hf_to_gguf.py writes
llama.cpp's keys, tensor names and ggml shapes, its storage types and its Q/K row order (the
round trips: test_gguf_ssm.py)."""

from __future__ import annotations

import json
import re
import shutil
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from model.load.gguf import open_gguf
from model.load.gguf_file import GGUFFile
from model.load.hf_to_gguf import NOPE_CONTEXT, convert
from tests.model.ssm_gguf import (
    ggml_shapes,
    hf_state,
    load_gguf,
)

transformers = pytest.importorskip("transformers")


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


# ---- Mamba2 ----


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
    # every *_norm.weight F32, the 2-D ssm_norm [G, d_inner/G] too: llama.cpp's converter's
    # rule (convert_hf_to_gguf's conversion/base.py, llama-cpp-python 0.3.36's llama.cpp)
    names = ("ssm_conv1d.weight", "ssm_conv1d.bias", "ssm_a", "ssm_d", "attn_norm.weight")
    for name in (*names, "ssm_norm.weight"):
        assert types[f"blk.0.{name}"] == "F32", name
    args, weights = load_gguf(path)
    sd = hf_state(mamba2_dir)
    w = sd["backbone.layers.1.mixer.in_proj.weight"]
    assert torch.equal(weights["layers.1.ssm_in"], w.half().float())
    assert torch.equal(weights["layers.1.ssm_conv_b"], sd["backbone.layers.1.mixer.conv1d.bias"])


# ---- Granite 4.0-H ----


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
