"""What a Mamba2 / Granite 4.0-H GGUF or HF folder (or a Mamba folder to convert) cannot be,
said clearly: a bad key, a missing or misshapen tensor, a truncated file, what llama.cpp's
layout cannot hold; and a quantized file loads dequantized. The round trips themselves:
test_gguf_ssm.py (whose helpers these use)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from model import ModelLoadError
from model.load.gguf import open_gguf
from model.load.hf_to_gguf import convert
from tests.model.ssm_gguf import load_gguf, make_granite, make_mamba2
from tests.tiny_ssm import write_tiny_mamba

pytest.importorskip("transformers")


def rewrite(
    src: Path,
    dst: Path,
    set_kv: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    add: dict[str, np.ndarray] | None = None,
    qtype: str = "",
) -> Path:
    """A copy of a GGUF with keys replaced or added, tensors dropped or added, and with
    `qtype` the 2-D weights but the conv quantized (as llama-quantize leaves it)."""
    reader = gguf.GGUFReader(src)  # the writer wants each field's value types
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    set_kv = dict(set_kv or {})
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = set_kv.pop(key, field.contents())
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub)
    for key, value in set_kv.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.UINT32)
    for t in reader.tensors:
        w = np.array(t.data)
        if t.name in drop:
            continue
        if qtype and w.ndim == 2 and t.name.endswith(".weight") and "conv1d" not in t.name:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(t.name, gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(t.name, w)
    for name, w in (add or {}).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def granite_gguf(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("granite_err")
    folder = make_granite(tmp / "hf", ["mamba", "attention", "mamba", "attention"], False)
    return convert(folder, tmp / "g.gguf")


def test_the_rewrite_helper_keeps_a_loadable_file(granite_gguf, tmp_path):
    args, _ = load_gguf(granite_gguf)
    assert load_gguf(rewrite(granite_gguf, tmp_path / "copy.gguf"))[0] == args


def test_quantized_gguf_loads_dequantized(granite_gguf, tmp_path):
    _, want = load_gguf(granite_gguf)
    path = rewrite(granite_gguf, tmp_path / "q8.gguf", qtype="Q8_0")
    types = {t.name: t.tensor_type.name for t in open_gguf(path).tensors}
    assert types["blk.0.ssm_in.weight"] == types["blk.1.attn_q.weight"] == "Q8_0"
    assert types["blk.0.ssm_conv1d.weight"] == types["blk.0.ssm_a"] == "F32"
    _, got = load_gguf(path)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name in ("layers.0.ssm_in", "layers.0.ssm_norm", "layers.1.wv", "layers.3.w2"):
        w = want[name].numpy()
        if name.endswith("ssm_norm"):
            w = w.reshape(2, -1)  # quantized in llama.cpp's [G, d_inner / G]
        deq = gguf.quants.dequantize(gguf.quants.quantize(w, q8), q8).reshape(-1, w.shape[-1])
        assert torch.equal(got[name], torch.from_numpy(deq).reshape(want[name].shape)), name
    assert not torch.equal(got["layers.0.ssm_in"], want["layers.0.ssm_in"])
    for name in ("layers.0.ssm_conv", "layers.0.ssm_a", "layers.2.ssm_d", "layers.1.attn_norm"):
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize(
    "change, message",
    [
        (  # experts without their count per token (and without their tensors)
            dict(set_kv={"granitehybrid.expert_count": 4}),
            "expert_used_count",
        ),
        (
            dict(add={"blk.1.ffn_gate_exps.weight": np.zeros((4, 8, 64), np.float32)}),
            "ffn_gate_exps.weight means a mixture-of-experts",
        ),
        (dict(drop=("blk.2.ssm_in.weight",)), "tensor blk.2.ssm_in.weight is missing"),
        (
            dict(add={"blk.1.attn_output.bias": np.zeros(64, np.float32)}),
            "attention biases",
        ),
        (
            dict(add={"blk.1.ssm_in.weight": np.zeros((328, 64), np.float32)}),
            "does not use: blk.1.ssm_in.weight",
        ),
        (
            dict(set_kv={"granitehybrid.attention.head_count_kv": [0, 2, 0]}),
            "head_count_kv has 3 entries for 4 layers",
        ),
        (dict(set_kv={"granitehybrid.ssm.time_step_rank": 6}), "inconsistent Mamba2 sizes"),
        (dict(set_kv={"granitehybrid.ssm.state_size": 8}), "blk.0.ssm_in.weight has shape"),
        (dict(drop=("token_embd.weight",)), "tensor token_embd.weight is missing"),
    ],
)
def test_bad_gguf_is_refused_by_name(granite_gguf, tmp_path, change, message):
    bad = rewrite(granite_gguf, tmp_path / "bad.gguf", **change)
    with pytest.raises(ModelLoadError, match=message):
        load_gguf(bad)


def test_truncated_gguf_is_refused(granite_gguf, tmp_path):
    data = granite_gguf.read_bytes()
    for keep in (len(data) // 2, len(data) - 100, 64):
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(ModelLoadError, match="truncated or corrupt"):
            load_gguf(cut)


def test_converter_refuses_what_llama_cpp_cannot_hold(tmp_path):
    biased = make_mamba2(tmp_path / "bias", use_bias=True, num_hidden_layers=1)
    with pytest.raises(ModelLoadError, match="projection biases"):
        convert(biased, tmp_path / "bias.gguf")
    biased = make_granite(
        tmp_path / "attn_bias", ["attention"], True, attention_bias=True, num_hidden_layers=1
    )
    with pytest.raises(ModelLoadError, match="attention or MLP biases are not supported"):
        convert(biased, tmp_path / "attn_bias.gguf")
    for change, message in (
        ({"use_bias": True}, "Mamba in/out projection biases"),
        ({"intermediate_size": 96}, "inner size 96 is not 2 x hidden_size 64"),
        ({"hidden_act": "gelu"}, "silu only"),
    ):
        folder = write_tiny_mamba(tmp_path / f"mamba{len(message)}", n_layers=1)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ModelLoadError, match=message):
            convert(folder, tmp_path / "mamba.gguf")
    small = make_mamba2(tmp_path / "small", vocab_size=256, num_hidden_layers=1)
    with pytest.raises(ModelLoadError, match="tokenizer has ids up to 319, the embedding 256"):
        convert(small, tmp_path / "small.gguf")
    assert not any(tmp_path.glob("*.gguf"))
