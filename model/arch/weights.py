"""The weights an architecture needs: each kind's expected shape and the kinds of each block.

The loaders (model/load/gguf.py, hf.py, lora.py) check every tensor against these."""

from __future__ import annotations

from model.arch.args import ModelArgs

# kept in float32 whatever the model's dtype: LFM2-MoE's selection bias only picks the top-k
# among scores in [0, 1] (transformers keeps it a float32 buffer, llama.cpp's exp_probs_b F32)
FLOAT32_KINDS = frozenset(("moe_sel_b",))


def weight_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Expected shape of each weight kind (the last part of its name)."""
    d, f = args.dim, args.hidden_dim
    q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    full = args.block.qk_norm_full
    return {
        "tok_embeddings": (args.vocab_size, d),
        "output": (args.vocab_size, d),
        "norm": (d,),
        "attn_norm": (d,),
        "ffn_norm": (d,),
        "post_attn_norm": (d,),
        "post_ffn_norm": (d,),
        "q_norm": (q_dim if full else args.head_dim,),
        "k_norm": (kv_dim if full else args.head_dim,),
        "wq": (q_dim, d),
        "wk": (kv_dim, d),
        "wv": (kv_dim, d),
        "wo": (d, q_dim),
        "bq": (q_dim,),
        "bk": (kv_dim,),
        "bv": (kv_dim,),
        "bo": (d,),
        "sinks": (args.n_heads,),
        "w1": (f, d),
        "w3": (f, d),
        "w2": (d, f),
        **_ssm_shapes(args),
        **_moe_shapes(args),
        "shortconv_in": (3 * d, d),  # LFM2: rows B, C, x; conv.weight [dim, 1, L] squeezed
        "shortconv_conv": (d, args.short_conv),
        "shortconv_out": (d, d),
    }


def _moe_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The router and the experts' gate, up and down weights stacked [n_experts, out, in]."""
    m = args.moe
    if m is None:
        return {}
    e, d, f = m.n_experts, args.dim, m.expert_dim
    return {
        "moe_router": (e, d),
        "w1_exps": (e, f, d),
        "w3_exps": (e, f, d),
        "w2_exps": (e, d, f),
        "moe_router_b": (e,),
        "b1_exps": (e, f),
        "b3_exps": (e, f),
        "b2_exps": (e, d),
        "w1_shexp": (m.shared_dim, d),  # Qwen2-MoE's shared expert
        "w3_shexp": (m.shared_dim, d),
        "w2_shexp": (d, m.shared_dim),
        "shexp_gate": (d,),  # its gate's weights (HF shared_expert_gate [1, d])
        "moe_sel_b": (e,),  # LFM2-MoE's expert_bias: chooses, does not weigh
    }


def _mamba_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """A Mamba (1) layer's weights (HF layout; A = -exp(A_log) [d_inner, N] as llama.cpp's
    ssm_a)."""
    m = args.mamba
    if m is None:
        return {}
    d_inner, n = m.d_inner, m.d_state
    return {
        "ssm_in": (2 * d_inner, args.dim),  # rows: x, z
        "ssm_in_b": (2 * d_inner,),
        "ssm_conv": (d_inner, m.d_conv),  # conv1d.weight [d_inner, 1, K] squeezed
        "ssm_conv_b": (d_inner,),
        "ssm_x": (m.dt_rank + 2 * n, d_inner),  # x_proj: rows dt, B, C
        "ssm_dt": (d_inner, m.dt_rank),  # dt_proj.weight
        "ssm_dt_b": (d_inner,),  # dt_proj.bias
        "ssm_a": (d_inner, n),
        "ssm_d": (d_inner,),
        "ssm_out": (args.dim, d_inner),
        "ssm_out_b": (args.dim,),
        "ssm_dt_norm": (m.dt_rank,),  # Jamba's dt_layernorm, b_layernorm, c_layernorm
        "ssm_b_norm": (n,),
        "ssm_c_norm": (n,),
    }


def _ssm_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """A Mamba2 layer's weights (HF layout; A = -exp(A_log) as llama.cpp's ssm_a), or a Mamba
    one's (_mamba_shapes)."""
    s = args.ssm
    if s is None:
        return _mamba_shapes(args)
    return {
        "ssm_in": (s.d_in_proj, args.dim),  # rows: z, xBC, dt
        "ssm_in_b": (s.d_in_proj,),
        "ssm_conv": (s.conv_dim, s.d_conv),  # conv1d.weight [conv_dim, 1, K] squeezed
        "ssm_conv_b": (s.conv_dim,),
        "ssm_dt_b": (s.n_heads,),
        "ssm_a": (s.n_heads,),  # A = -exp(A_log)
        "ssm_d": (s.n_heads,),
        "ssm_norm": (s.d_inner,),
        "ssm_out": (args.dim, s.d_inner),
        "ssm_out_b": (args.dim,),
    }


def layer_weights(args: ModelArgs, layer: int = 0) -> tuple[str, ...]:
    """The weight kinds block `layer` of `args` needs (its LayerDesc, the Mamba / Mamba2
    biases and Jamba's dt / B / C norms)."""
    kinds = list(args.layer_desc(layer).weights)
    mixer = args.mixer(layer)
    if mixer in ("mamba2", "attn_mamba2") and args.ssm is not None and args.ssm.norm == "none":
        kinds.remove("ssm_norm")
    if mixer in ("mamba2", "mamba", "attn_mamba2"):
        s = args.mamba if mixer == "mamba" else args.ssm
        assert s is not None
        if s.conv_bias:
            kinds.append("ssm_conv_b")
        if s.proj_bias:
            kinds += ["ssm_in_b", "ssm_out_b"]
    if mixer == "mamba" and args.mamba is not None and args.mamba.dt_b_c_norm == "weighted":
        kinds += ["ssm_dt_norm", "ssm_b_norm", "ssm_c_norm"]
    return tuple(kinds)
