"""A tiny random Llama written as a Hugging Face folder, for fast tests anywhere in the repo."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from model.load.chat_template import CHATML_TEMPLATE

TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5-Coder's fill-in-the-middle tokens (write_tiny_llama(fim=True))
FIM_SPECIALS = (
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today? "
    "I am a tiny language model used in tests. 0123456789 + - * / = ( ) [ ] { } "
    "user assistant system: you are a helpful assistant."
)


def _tiny_tokenizer(specials: tuple[str, ...] = TINY_SPECIALS) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok


def write_tiny_llama(
    folder: str | Path,
    n_layers: int = 2,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    hidden_dim: int = 128,
    seed: int = 0,
    model_type: str = "llama",
    head_dim: int | None = None,
    fim: bool = False,
) -> Path:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
    generation_config.json of a random Llama (ChatML template) into `folder`; returns it.
    model_type "qwen2" adds the q/k/v biases, "qwen3" the q/k norms (and a `head_dim` that
    need not be dim / n_heads); `fim` adds FIM_SPECIALS to the vocabulary."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = _tiny_tokenizer(TINY_SPECIALS + FIM_SPECIALS if fim else TINY_SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos_id = tok.token_to_id("<|im_end|>")
    head_dim = head_dim or dim // n_heads
    archs = {
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "smollm3": "SmolLM3ForCausalLM",
    }
    config = {
        "architectures": [archs.get(model_type, "LlamaForCausalLM")],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": dim,
        "intermediate_size": hidden_dim,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": tok.token_to_id("<|im_start|>"),
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    if model_type == "smollm3":  # its config's default pad id (128004) is past this vocab
        config["pad_token_id"] = eos_id
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tok_config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "chat_template": CHATML_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    tensors = {
        "model.embed_tokens.weight": rand(vocab, dim, scale=1.0),
        "model.norm.weight": 1.0 + rand(dim, scale=0.1),
    }
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1.0 + rand(dim, scale=0.1),
            p + "post_attention_layernorm.weight": 1.0 + rand(dim, scale=0.1),
            p + "self_attn.q_proj.weight": rand(n_heads * head_dim, dim),
            p + "self_attn.k_proj.weight": rand(n_kv_heads * head_dim, dim),
            p + "self_attn.v_proj.weight": rand(n_kv_heads * head_dim, dim),
            p + "self_attn.o_proj.weight": rand(dim, n_heads * head_dim),
            p + "mlp.gate_proj.weight": rand(hidden_dim, dim),
            p + "mlp.up_proj.weight": rand(hidden_dim, dim),
            p + "mlp.down_proj.weight": rand(dim, hidden_dim),
        }
        if model_type == "qwen3":
            tensors |= {
                p + "self_attn.q_norm.weight": 1.0 + rand(head_dim, scale=0.1),
                p + "self_attn.k_norm.weight": 1.0 + rand(head_dim, scale=0.1),
            }
        if model_type == "qwen2":
            tensors |= {
                p + "self_attn.q_proj.bias": rand(n_heads * head_dim),
                p + "self_attn.k_proj.bias": rand(n_kv_heads * head_dim),
                p + "self_attn.v_proj.bias": rand(n_kv_heads * head_dim),
            }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def write_tiny_gemma3(
    folder: str | Path,
    layer_types: tuple[str, ...] = ("sliding", "sliding", "sliding", "full"),
    window: int = 8,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 16,
    hidden_dim: int = 128,
    seed: int = 0,
    linear_rope: float = 1.0,
) -> Path:
    """A random text-only Gemma 3 (gemma3_text) HF folder with write_tiny_llama's tokenizer:
    sliding layers of `window`, (1 + w) norms stored as w, q/k norms, query_pre_attn_scalar
    different from head_dim; `linear_rope` != 1 scales the global layers' RoPE linearly (the
    4B and larger)."""
    folder = write_tiny_llama(folder, n_layers=len(layer_types), seed=seed)
    config = json.loads((folder / "config.json").read_text())
    vocab = config["vocab_size"]
    config.update(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        hidden_size=dim,
        intermediate_size=hidden_dim,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        sliding_window=window,
        layer_types=[f"{t}_attention" for t in layer_types],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6}
            if linear_rope == 1.0
            else {"rope_type": "linear", "factor": linear_rope, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        query_pre_attn_scalar=24,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )
    config.pop("rope_theta")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    tensors = {"model.embed_tokens.weight": rand(vocab, dim, scale=1.0)}
    tensors["model.norm.weight"] = rand(dim, scale=0.1)
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    for i in range(len(layer_types)):
        p = f"model.layers.{i}."
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            tensors[f"{p}{norm}_layernorm.weight"] = rand(dim, scale=0.1)
        tensors |= {
            p + "self_attn.q_norm.weight": rand(head_dim, scale=0.1),
            p + "self_attn.k_norm.weight": rand(head_dim, scale=0.1),
            p + "self_attn.q_proj.weight": rand(q_dim, dim),
            p + "self_attn.k_proj.weight": rand(kv_dim, dim),
            p + "self_attn.v_proj.weight": rand(kv_dim, dim),
            p + "self_attn.o_proj.weight": rand(dim, q_dim),
            p + "mlp.gate_proj.weight": rand(hidden_dim, dim),
            p + "mlp.up_proj.weight": rand(hidden_dim, dim),
            p + "mlp.down_proj.weight": rand(dim, hidden_dim),
        }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


_PERMUTED = ("llama", "smollm3", "granite", "granitemoe")  # llama.cpp's LLAMA_ROPE_TYPE_NORM archs


def _permute_for_gguf(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute (HF rotate-half -> interleaved)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


SPM_PIECES = [
    "▁",
    "e",
    "t",
    "h",
    "o",
    "l",
    "w",
    "r",
    "d",
    "a",
    "n",
    "s",
    "i",
    "u",
    "m",
    "y",
    ",",
    ".",
    "!",
    "?",
    "▁t",
    "he",
    "▁the",
    "ll",
    "▁h",
    "▁he",
    "llo",
    "▁hello",
    "▁w",
    "or",
    "▁wor",
    "ld",
    "▁world",
    "in",
    "▁a",
    "an",
    "▁an",
    "is",
    "▁is",
    "▁th",
    "▁i",
    "▁s",
    "▁m",
    "my",
    "▁my",
    "▁▁",
    "▁▁▁▁",
]


def _add_spm_tokenizer(writer: gguf.GGUFWriter) -> None:
    """A SentencePiece-BPE vocab (llama 2 / TinyLlama style): <unk> <s> </s>, 256 byte tokens,
    then pieces scored best-first."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(SPM_PIECES)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES))
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)


def write_tiny_gguf(
    path: str | Path,
    hf_folder: str | Path,
    arch: str = "llama",
    skip: tuple[str, ...] = (),
    spm_tokenizer: bool = False,
    qtype: str = "F32",
    fim_ids: dict[str, int] | None = None,
    extra: Callable[[gguf.GGUFWriter], dict[str, np.ndarray]] | None = None,
) -> Path:
    """Convert a tiny HF folder (from write_tiny_llama) to GGUF the way llama.cpp does (F32,
    Q/K permuted, gpt2 tokenizer, or a small SentencePiece vocab with `spm_tokenizer`);
    `skip` leaves out tensors by GGUF name; `qtype` (F16, BF16, Q8_0, Q4_0, Q4_1, ...) is
    the type of the 2-D weights, quantized with gguf.quants; `fim_ids` ("pre", "suf", ...)
    are written as tokenizer.ggml.fim_*_token_id; `extra` writes more metadata and returns
    more tensors by GGUF name (tests/tiny_moe.py: the experts)."""
    path, hf_folder = Path(path), Path(hf_folder)
    config = json.loads((hf_folder / "config.json").read_text())
    spec = json.loads((hf_folder / "tokenizer.json").read_text())
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(config.get("rope_theta", rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim", config["hidden_size"] // n_heads) != config["hidden_size"] // n_heads:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if spm_tokenizer:
        _add_spm_tokenizer(writer)
    else:
        vocab = Tokenizer.from_file(str(hf_folder / "tokenizer.json")).get_vocab(True)
        tokens = sorted(vocab, key=vocab.__getitem__)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        specials = {a["content"] for a in spec.get("added_tokens", []) if a.get("special")}
        writer.add_token_types([3 if t in specials else 1 for t in tokens])
        merges = spec["model"]["merges"]
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
        writer.add_bos_token_id(config["bos_token_id"])
        writer.add_eos_token_id(config["eos_token_id"])
        writer.add_add_bos_token(False)
    for kind, token_id in (fim_ids or {}).items():
        writer.add_uint32(f"tokenizer.ggml.fim_{kind}_token_id", token_id)
    writer.add_chat_template(CHATML_TEMPLATE)
    tensors = load_file(str(hf_folder / "model.safetensors"))
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    hf_to_gguf = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for i in range(config["num_hidden_layers"]):
        for hf_name, gguf_name in hf_to_gguf.items():
            names[f"model.layers.{i}.{hf_name}"] = f"blk.{i}.{gguf_name}"
        if f"model.layers.{i}.self_attn.q_norm.weight" in tensors:
            names[f"model.layers.{i}.self_attn.q_norm.weight"] = f"blk.{i}.attn_q_norm.weight"
            names[f"model.layers.{i}.self_attn.k_norm.weight"] = f"blk.{i}.attn_k_norm.weight"
        if arch == "qwen2":
            for proj in "qkv":
                names[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = f"blk.{i}.attn_{proj}.bias"
    arrays = {g: tensors[h].numpy().astype(np.float32) for h, g in names.items() if h in tensors}
    arrays |= extra(writer) if extra is not None else {}
    for gguf_name, w in arrays.items():
        if gguf_name in skip:
            continue
        if arch in _PERMUTED and gguf_name.endswith("attn_q.weight"):
            w = _permute_for_gguf(w, n_heads)
        elif arch in _PERMUTED and gguf_name.endswith("attn_k.weight"):
            w = _permute_for_gguf(w, n_kv)
        if qtype == "F32" or w.ndim == 1 or gguf_name.endswith("ffn_gate_inp.weight"):
            writer.add_tensor(gguf_name, w)
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
        if ab == "b" and arch in _PERMUTED and proj in heads:
            w = _permute_for_gguf(w, heads[proj])
        writer.add_tensor(f"blk.{layer}.{names[module]}.weight.lora_{ab}", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
