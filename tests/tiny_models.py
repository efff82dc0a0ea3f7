"""Tiny random Llama and Gemma 3 models written as Hugging Face folders, for fast tests anywhere in
the repo; their GGUFs: tests/tiny_gguf.py; LoRA adapters over them: tests/tiny_lora.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
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
