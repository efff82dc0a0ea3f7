"""A tiny random Llama written as a Hugging Face folder, for fast tests anywhere in the repo."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from model.chat_template import CHATML_TEMPLATE

TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today? "
    "I am a tiny language model used in tests. 0123456789 + - * / = ( ) [ ] { } "
    "user assistant system: you are a helpful assistant."
)


def _tiny_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=list(TINY_SPECIALS),
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
) -> Path:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
    generation_config.json of a random Llama (ChatML template) into `folder`; returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = _tiny_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos_id = tok.token_to_id("<|im_end|>")
    head_dim = dim // n_heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder
