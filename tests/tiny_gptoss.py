"""A tiny random gpt-oss (GptOssForCausalLM) built and saved by transformers: attention sinks,
q/k/v/o biases, every other layer sliding over a small window, YaRN RoPE, and a biased router
over experts with the clamped SwiGLU. Its GGUF is written by llama.cpp's own converter
(tests/llamacpp_convert.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.tiny_models import write_tiny_llama

WINDOW = 8  # a ~40-token prompt passes it several times over
# YaRN over a short original context, so that the ramp between kept and interpolated pairs
# falls inside head_dim 32 (gpt-oss-20b: factor 32 over 4,096, truncate False)
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    beta_fast=32.0,
    beta_slow=1.0,
    original_max_position_embeddings=64,
    truncate=False,
)


def write_tiny_gptoss(
    folder: str | Path, n_layers: int = 4, seed: int = 0, **config_kw: object
) -> Path:
    """dim 64; 4 query heads of 32 (head_dim * heads != dim) over 2 K/V heads; 4 experts of
    width 32, 2 per token; layers 0, 2 slide by WINDOW. Weights ~ N(0, 0.1), but the experts'
    gate_up ~ N(0, 1) so that the SwiGLU's clamp at 7 cuts some gates and ups; router and
    sinks ~ N(0, 1); norms 1 + N(0, 0.1). `config_kw` overrides config fields."""
    import transformers

    folder = write_tiny_llama(folder, seed=seed)  # the tokenizer files, then the model's own
    base = json.loads((folder / "config.json").read_text())
    config = dict(
        vocab_size=base["vocab_size"],
        hidden_size=64,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        max_position_embeddings=256,
        rope_parameters=dict(YARN),
        rms_norm_eps=1e-5,
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
        pad_token_id=base["eos_token_id"],
        tie_word_embeddings=False,
    )
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**(config | config_kw)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(("sinks", "router.weight", "router.bias", "gate_up_proj")):
                p.copy_(noise)
            else:
                p.copy_(0.1 * noise)
    model.save_pretrained(folder)
    return folder


# E2M1 codes 0..15 (the OCP MX spec; transformers' FP4_VALUES, ggml's kvalues_mxfp4 / 2)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# the experts' E8M0 exponents (2^(e - 127)): gate_up up to 6 * 2^-1 (the clamp at 7 cuts some
# of their products), down up to 6 * 2^-4
_MXFP4_EXPONENTS = {"gate_up_proj": 126, "down_proj": 123}


def write_tiny_gptoss_mxfp4(folder: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """write_tiny_gptoss's model (YaRN truncated, as llama.cpp reads it) with experts made of
    random MXFP4 blocks, saved twice: `folder`/float with the experts dequantized (what
    transformers runs) and `folder`/mxfp4 as OpenAI's checkpoints store them (`*_blocks` [E,
    out, in / 32, 16] two codes a byte, element 2j in the low nibble; `*_scales` [E, out, in /
    32] E8M0; quantization_config mxfp4), which llama.cpp's converter repacks to ggml MXFP4."""
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    float_dir = write_tiny_gptoss(
        folder / "float", seed=seed, rope_parameters=YARN | {"truncate": True}
    )
    tensors = load_file(str(float_dir / "model.safetensors"))
    packed = dict(tensors)
    gen = torch.Generator().manual_seed(seed)
    lut = torch.tensor(E2M1)
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        n_exp, n_in, n_out = tensors[name].shape  # x @ W: [E, in, out]
        codes = torch.randint(0, 16, (n_exp, n_out, n_in), generator=gen, dtype=torch.uint8)
        exps = _MXFP4_EXPONENTS[name.rsplit(".", 1)[-1]] + torch.randint(
            -1, 2, (n_exp, n_out, n_in // 32), generator=gen
        )
        values = lut[codes.long()] * torch.exp2(exps.float() - 127).repeat_interleave(32, -1)
        tensors[name] = values.transpose(1, 2).contiguous()
        pairs = codes.view(n_exp, n_out, n_in // 32, 16, 2)
        del packed[name]
        packed[name + "_blocks"] = pairs[..., 0] | (pairs[..., 1] << 4)
        packed[name + "_scales"] = exps.to(torch.uint8)
    save_file(tensors, str(float_dir / "model.safetensors"))
    mxfp4_dir = folder / "mxfp4"
    mxfp4_dir.mkdir(parents=True, exist_ok=True)
    for file in float_dir.iterdir():
        if file.name != "model.safetensors":
            (mxfp4_dir / file.name).write_bytes(file.read_bytes())
    config = json.loads((mxfp4_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (mxfp4_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(packed, str(mxfp4_dir / "model.safetensors"))
    return float_dir, mxfp4_dir
