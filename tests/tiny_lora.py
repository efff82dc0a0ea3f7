"""LoRA adapters over a tiny HF folder (tests/tiny_models.py): PEFT's own, and the same written
as llama.cpp's convert_lora_to_gguf.py writes it."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from tests.tiny_gguf import PERMUTED_ARCHS, permute_for_gguf


def write_peft_adapter(
    base: Path, out: Path, seed: int, targets: list[str], r: int = 4, **config: object
) -> Path:
    """A PEFT LoRA over the HF model at `base` with random A and B (PEFT starts B at zero);
    `targets`: PEFT's target_modules (q_proj, ..., down_proj)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    lora_config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, **config)
    model = peft.get_peft_model(model, lora_config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    model.save_pretrained(out)
    return out


def write_tiny_gguf_lora(path: str | Path, peft_folder: str | Path, arch: str = "llama") -> Path:
    """A PEFT LoRA folder written as llama.cpp's convert_lora_to_gguf.py writes it:
    general.type "adapter", adapter.type "lora", adapter.lora.alpha, F32 tensors
    `blk.{i}.<base tensor>.weight.lora_a` [r, in] and `.lora_b` [out, r], B of Q and K permuted
    as the base's rows are (llama's interleaved RoPE pairs)."""
    path, peft_folder = Path(path), Path(peft_folder)
    config = json.loads((peft_folder / "adapter_config.json").read_text())
    base_config = json.loads((Path(config["base_model_name_or_path"]) / "config.json").read_text())
    heads = {"q": base_config["num_attention_heads"], "k": base_config["num_key_value_heads"]}
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    for key, t in sorted(load_file(str(peft_folder / "adapter_model.safetensors")).items()):
        layer = int(key.split("layers.")[1].split(".")[0])
        module = next(n for n in names if f".{n}.lora_" in key)
        ab = "a" if ".lora_A." in key else "b"
        w = t.float().numpy()
        proj = names[module].removeprefix("attn_")
        if ab == "b" and arch in PERMUTED_ARCHS and proj in heads:
            w = permute_for_gguf(w, heads[proj])
        writer.add_tensor(f"blk.{layer}.{names[module]}.weight.lora_{ab}", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
