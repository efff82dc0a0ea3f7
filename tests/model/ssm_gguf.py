"""Tiny random Mamba2 and Granite 4.0-H models saved by transformers, and their GGUFs read back
through model/load/gguf.py: what test_gguf_ssm.py and test_gguf_ssm_refusals.py build on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from model.arch import ModelArgs
from model.load.gguf import open_gguf, read_args, read_weights
from model.load.gguf_file import GGUFFile
from tests.tiny_models import write_tiny_llama

transformers = pytest.importorskip("transformers")

MAMBA2 = dict(
    vocab_size=2048,
    hidden_size=64,
    expand=2,
    num_heads=8,
    head_dim=16,
    n_groups=2,
    state_size=16,
    conv_kernel=4,
    num_hidden_layers=3,
    chunk_size=8,
)
GRANITE = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=96,  # the experts' width: unused by a dense model
    shared_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=0,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=8,
    embedding_multiplier=2.0,
    residual_multiplier=0.5,
    attention_multiplier=0.25,
    logits_scaling=4.0,
    rms_norm_eps=1e-6,
)


# the tests' Granite layouts: (layer_types, rope)
GRANITE_CASES = {
    "nope-mamba-first": (["mamba", "attention", "mamba", "attention"], False),
    "rope-attention-first": (["attention", "mamba", "mamba", "attention"], True),
}


def f32(x: float) -> float:
    """GGUF stores float32 scalars (as llama.cpp reads them)."""
    return float(np.float32(x))


def save_random(folder: Path, model: Any, seed: int = 0) -> Path:
    """Every parameter redrawn (HF init sets A_log = log(1..H), D = norm = 1, which hide
    layout bugs), saved with write_tiny_llama's tokenizer files."""
    write_tiny_llama(folder)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(folder)
    return folder


def make_mamba2(folder: Path, **overrides: Any) -> Path:
    config = transformers.Mamba2Config(**(MAMBA2 | overrides))
    return save_random(folder, transformers.Mamba2ForCausalLM(config))


def make_granite(folder: Path, layer_types: list[str], rope: bool, **overrides: Any) -> Path:
    config = transformers.GraniteMoeHybridConfig(
        **(GRANITE | overrides),
        layer_types=layer_types,
        position_embedding_type="rope" if rope else "nope",
    )
    return save_random(folder, transformers.GraniteMoeHybridForCausalLM(config), seed=1)


def hf_state(folder: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


def load_gguf(path: Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    reader = open_gguf(path)
    args = read_args(reader, path)
    return args, read_weights(reader, args, path, torch.float32)


def ssm_weights(sd: dict[str, torch.Tensor], mixer: str) -> dict[str, torch.Tensor]:
    """The contract's Mamba2 weights from an HF mixer's state dict."""
    return {
        "ssm_in": sd[mixer + "in_proj.weight"],
        "ssm_conv": sd[mixer + "conv1d.weight"][:, 0, :],
        "ssm_conv_b": sd[mixer + "conv1d.bias"],
        "ssm_dt_b": sd[mixer + "dt_bias"],
        "ssm_a": -torch.exp(sd[mixer + "A_log"]),
        "ssm_d": sd[mixer + "D"],
        "ssm_norm": sd[mixer + "norm.weight"],
        "ssm_out": sd[mixer + "out_proj.weight"],
    }


def assert_same_weights(ours: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(want)
    for name, w in want.items():
        if name.endswith("ssm_a"):  # exp in numpy (converter) vs torch: within an ulp
            torch.testing.assert_close(ours[name], w, rtol=2.5e-7, atol=0)
        else:
            assert torch.equal(ours[name], w), name


def ggml_shapes(reader: GGUFFile) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
