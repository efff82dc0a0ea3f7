"""Tiny random Mamba2 and Granite 4.0-H (GraniteMoeHybrid) Hugging Face folders, written by
transformers itself (its config and save_pretrained) with EVERY parameter redrawn: its init
sets A_log = log(1..H), D = 1, norms = 1, which hide transpositions and group mix-ups.
Bamba too. Needs transformers (the `test` extra)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def _redraw(model: Any, seed: int) -> None:
    """Every parameter ~ its own scale: norms 1 + N(0, 0.1), embeddings N(0, 1), A_log, dt_bias
    and D N(0, 0.5), everything else N(0, 0.15)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("norm.weight", "norm_f.weight", "layernorm.weight")):
                p.copy_(1.0 + 0.1 * noise)
            elif "embed" in name:
                p.copy_(noise)
            elif name.endswith(("A_log", "dt_bias", ".D")):
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.15 * noise)


def _long_memory(model: Any, seed: int) -> None:
    """Make the SSM states remember: A = -exp(A_log) ~ -0.02 and dt ~ 0.13 keep ~99.7% of a
    state a token (the redrawn N(0, 0.5) forgets within a few tokens, so a lost or zeroed
    state would change no output a test can see)."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(-4.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.full(p.shape, -2.0))


def _save(folder: Path, model: Any) -> Path:
    """save_pretrained over write_tiny_llama's folder (keeping its tokenizer files)."""
    for old in folder.glob("*.safetensors"):
        old.unlink()
    model.save_pretrained(folder)
    return folder


def _tokenizer_folder(folder: str | Path) -> tuple[Path, dict[str, Any]]:
    from tests.tiny_models import write_tiny_llama

    folder = write_tiny_llama(folder)
    config = json.loads((folder / "config.json").read_text())
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id")}
    return folder, ids | {"pad_token_id": config["eos_token_id"]}


def write_tiny_mamba2(
    folder: str | Path,
    n_layers: int = 3,
    dim: int = 64,
    n_heads: int = 8,
    head_dim: int = 16,
    d_state: int = 16,
    n_groups: int = 2,
    d_conv: int = 4,
    vocab: int = 2048,
    seed: int = 0,
    conv_bias: bool = True,
    proj_bias: bool = False,
    long_memory: bool = False,
) -> Path:
    """A random Mamba2 (expand 2, untied head) with write_tiny_llama's tokenizer;
    `long_memory`: states that forget slowly (_long_memory)."""
    import transformers

    folder, ids = _tokenizer_folder(folder)
    config = transformers.Mamba2Config(
        vocab_size=vocab,
        hidden_size=dim,
        expand=2,
        num_heads=n_heads,
        head_dim=head_dim,
        n_groups=n_groups,
        state_size=d_state,
        conv_kernel=d_conv,
        num_hidden_layers=n_layers,
        chunk_size=8,
        use_conv_bias=conv_bias,
        use_bias=proj_bias,
        tie_word_embeddings=False,
        **ids,
    )
    model = transformers.Mamba2ForCausalLM(config)
    _redraw(model, seed)
    if long_memory:
        _long_memory(model, seed)
    return _save(folder, model)


def write_tiny_mamba(
    folder: str | Path,
    n_layers: int = 3,
    dim: int = 64,
    d_state: int = 16,
    d_conv: int = 4,
    dt_rank: int = 6,
    vocab: int = 2048,
    seed: int = 0,
    falcon: bool = False,
    conv_bias: bool = True,
    proj_bias: bool = False,
    tie: bool = True,
    long_memory: bool = False,
) -> Path:
    """A random Mamba (1) (expand 2; `falcon`: Falcon-Mamba, its dt / B / C normed) with
    write_tiny_llama's tokenizer; `long_memory`: states that forget slowly (_long_memory, and
    dt_proj's bias for Mamba's dt)."""
    import transformers

    folder, ids = _tokenizer_folder(folder)
    kind = transformers.FalconMambaConfig if falcon else transformers.MambaConfig
    config = kind(
        vocab_size=vocab,
        hidden_size=dim,
        expand=2,
        state_size=d_state,
        conv_kernel=d_conv,
        time_step_rank=dt_rank,
        num_hidden_layers=n_layers,
        use_conv_bias=conv_bias,
        use_bias=proj_bias,
        tie_word_embeddings=tie,
        **ids,
    )
    cls = transformers.FalconMambaForCausalLM if falcon else transformers.MambaForCausalLM
    model = cls(config)
    _redraw(model, seed)
    if long_memory:
        _long_memory(model, seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("dt_proj.bias"):
                    p.copy_(torch.full(p.shape, -2.0))
    if tie:
        model.tie_weights()
    return _save(folder, model)


def write_tiny_jamba(
    folder: str | Path,
    n_layers: int = 5,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    hidden_dim: int = 96,
    experts: int = 4,
    attn_period: int = 3,
    attn_offset: int = 1,
    expert_period: int = 2,
    expert_offset: int = 1,
    seed: int = 0,
    long_memory: bool = False,
) -> Path:
    """A random Jamba (NoPE attention on layers i % attn_period == attn_offset, Mamba elsewhere;
    `experts` experts (top 2) on i % expert_period == expert_offset, a dense MLP elsewhere)
    with write_tiny_llama's tokenizer."""
    import transformers

    folder, ids = _tokenizer_folder(folder)
    config = transformers.JambaConfig(
        vocab_size=2048,
        hidden_size=dim,
        intermediate_size=hidden_dim,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        num_experts=experts,
        num_experts_per_tok=2,
        expert_layer_period=expert_period,
        expert_layer_offset=expert_offset,
        attn_layer_period=attn_period,
        attn_layer_offset=attn_offset,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=6,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        **ids,
    )
    model = transformers.JambaForCausalLM(config)
    _redraw(model, seed)
    if long_memory:
        _long_memory(model, seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("dt_proj.bias"):
                    p.copy_(torch.full(p.shape, -2.0))
    return _save(folder, model)


def write_tiny_granite_hybrid(
    folder: str | Path,
    layer_types: tuple[str, ...] = ("mamba", "attention", "mamba", "mamba", "attention"),
    rope: bool = False,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    hidden_dim: int = 96,
    mamba_heads: int = 8,
    mamba_head_dim: int = 16,
    d_state: int = 16,
    n_groups: int = 2,
    d_conv: int = 4,
    vocab: int = 2048,
    seed: int = 0,
    tie: bool = True,
    long_memory: bool = False,
    experts: int = 0,
) -> Path:
    """A random GraniteMoeHybrid (Granite 4.0-H; `rope` True: Bamba-like rope attention) with
    multipliers != 1 and write_tiny_llama's tokenizer. layer_types: "mamba" / "attention";
    `long_memory`: states that forget slowly (_long_memory); `experts` > 0: H-Tiny's shape,
    every layer `experts` experts 32 wide (top 2) beside the shared MLP."""
    import transformers

    folder, ids = _tokenizer_folder(folder)
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=32 if experts else hidden_dim,
        shared_intermediate_size=hidden_dim,
        num_hidden_layers=len(layer_types),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        num_local_experts=experts,
        num_experts_per_tok=2,
        layer_types=list(layer_types),
        mamba_n_heads=mamba_heads,
        mamba_d_head=mamba_head_dim,
        mamba_n_groups=n_groups,
        mamba_d_state=d_state,
        mamba_d_conv=d_conv,
        mamba_expand=2,
        mamba_chunk_size=8,
        position_embedding_type="rope" if rope else "nope",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=8192,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
        logits_scaling=4.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        **ids,
    )
    model = transformers.GraniteMoeHybridForCausalLM(config)
    _redraw(model, seed)
    if long_memory:
        _long_memory(model, seed)
    if tie:
        model.tie_weights()
    return _save(folder, model)


def write_tiny_bamba(
    folder: str | Path, attn_layers: tuple[int, ...] = (1, 3), n_layers: int = 4, seed: int = 0
) -> Path:
    """A random Bamba (Mamba2 + rope attention on half the head dims, a SwiGLU MLP in every
    layer) with write_tiny_llama's tokenizer."""
    import transformers

    folder, ids = _tokenizer_folder(folder)
    config = transformers.BambaConfig(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=list(attn_layers),
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=8,
        **ids,
    )
    model = transformers.BambaForCausalLM(config)
    _redraw(model, seed)
    return _save(folder, model)


LFM2_LAYERS = ("conv", "full_attention", "conv", "conv", "full_attention")


def write_tiny_lfm2(
    folder: str | Path,
    layer_types: tuple[str, ...] = LFM2_LAYERS,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ff_dim: int = 160,
    conv_cache: int = 3,
    seed: int = 0,
    vocab: int = 2048,
) -> Path:
    """A random Lfm2ForCausalLM (LFM2: gated short convolutions and GQA attention with q/k
    norms, tied embeddings of N(0, 0.15)) with write_tiny_llama's tokenizer. `ff_dim` 160 goes
    through LFM2's auto-adjust (2/3, rounded up to block_multiple_of 32): an MLP of width 128."""
    import transformers

    folder, ids = _tokenizer_folder(folder)
    config = transformers.Lfm2Config(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=ff_dim,
        num_hidden_layers=len(layer_types),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        layer_types=list(layer_types),
        conv_L_cache=conv_cache,
        block_multiple_of=32,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        norm_eps=1e-5,
        tie_word_embeddings=True,
        **ids,
    )
    model = transformers.Lfm2ForCausalLM(config)
    _redraw(model, seed)
    with torch.no_grad():  # NOTE: tied, so also the output: logits spread ~10, not ~65
        model.model.embed_tokens.weight.mul_(0.15)
    model.tie_weights()
    return _save(folder, model)


def write_tiny_lfm2_moe(
    folder: str | Path,
    layer_types: tuple[str, ...] = LFM2_LAYERS,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ff_dim: int = 96,
    expert_dim: int = 32,
    n_experts: int = 8,
    n_used: int = 2,
    dense_layers: int = 1,
    scale: float = 1.5,
    seed: int = 0,
    vocab: int = 2048,
) -> Path:
    """A random Lfm2MoeForCausalLM (LFM2-8B-A1B's shape: LFM2's layers, the first
    `dense_layers` with a dense MLP `ff_dim` wide, the others `n_experts` experts `expert_dim`
    wide routed by sigmoid scores, chosen with a selection bias ~ N(0, 0.1) that does not weigh
    them, the top `n_used` renormalized and times the routed scaling `scale`)."""
    import transformers

    folder, ids = _tokenizer_folder(folder)
    config = transformers.Lfm2MoeConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=ff_dim,
        moe_intermediate_size=expert_dim,
        num_hidden_layers=len(layer_types),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        layer_types=list(layer_types),
        conv_L_cache=3,
        num_dense_layers=dense_layers,
        num_experts=n_experts,
        num_experts_per_tok=n_used,
        use_expert_bias=True,
        routed_scaling_factor=scale,
        norm_topk_prob=True,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        norm_eps=1e-5,
        tie_word_embeddings=True,
        **ids,
    )
    model = transformers.Lfm2MoeForCausalLM(config)
    _redraw(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.15)
        for layer in model.model.layers[dense_layers:]:
            bias = layer.feed_forward.expert_bias
            bias.copy_(0.1 * torch.randn(bias.shape, generator=gen))
    model.tie_weights()
    return _save(folder, model)


def write_tiny_falcon_h1(
    folder: str | Path,
    n_layers: int = 3,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 24,
    hidden_dim: int = 96,
    mamba_heads: int = 8,
    mamba_head_dim: int = 12,
    n_groups: int = 2,
    d_state: int = 16,
    rms_norm: bool = True,
    norm_before_gate: bool = False,
    vocab: int = 2048,
    seed: int = 0,
    long_memory: bool = False,
    tied: bool = False,
) -> Path:
    """A random Falcon-H1 (attention and a Mamba2 mixer in every layer) with every muP
    multiplier away from 1, head sizes that are not dim / heads and a mamba_d_ssm that is not
    expand x dim; write_tiny_llama's tokenizer. `tied`: the output head is the embedding table
    (read unscaled: embedding_multiplier scales the inputs only)."""
    import transformers

    folder, ids = _tokenizer_folder(folder)
    config = transformers.FalconH1Config(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=hidden_dim,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        mamba_n_heads=mamba_heads,
        mamba_d_head=mamba_head_dim,
        mamba_d_ssm=mamba_heads * mamba_head_dim,
        mamba_n_groups=n_groups,
        mamba_d_state=d_state,
        mamba_d_conv=4,
        mamba_chunk_size=8,
        mamba_rms_norm=rms_norm,
        mamba_norm_before_gate=norm_before_gate,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=8192,
        embedding_multiplier=2.0,
        lm_head_multiplier=0.5,
        attention_in_multiplier=0.8,
        key_multiplier=1.3,
        attention_out_multiplier=0.7,
        ssm_in_multiplier=1.2,
        ssm_multipliers=[0.9, 1.1, 0.8, 1.25, 0.6],
        ssm_out_multiplier=0.75,
        mlp_multipliers=[1.1, 0.9],
        tie_word_embeddings=tied,
        **ids,
    )
    model = transformers.FalconH1ForCausalLM(config)
    _redraw(model, seed)
    if long_memory:
        _long_memory(model, seed)
    return _save(folder, model)
