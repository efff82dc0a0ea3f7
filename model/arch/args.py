"""What a decoder computes: a small description over the shared blocks, not a copy of the forward.

`BlockSpec` says which norms, MLP activation and extras every block uses; `ModelArgs` adds the
sizes and the per-layer attention (sliding window, RoPE). `ModelArgs.layer_desc(i)` folds them
into one `LayerDesc` per layer: what block i computes. Both forwards follow it:
model/layers/decoder.py's Block (the Python layers) and model/runner/native.py's C++ step
(step.cpp), which reads the same parts by the same names, so an architecture described here
runs on both without a line of C++. Each family's file in model/arch/ (model/arch/family.py
lists them) says how its GGUF metadata and HF config map onto these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvcache.rope import RopeConfig
from kvcache.spec import Attention as AttentionSpec
from kvcache.spec import MemorySpec
from kvcache.spec import Recurrent as RecurrentSpec
from model.arch.ssm_args import MambaArgs, SSMArgs

# "swiglu_oai": gpt-oss's clamped SwiGLU over the experts (MoEArgs.swiglu_limit, swiglu_alpha)
Activation = Literal["silu", "gelu_tanh", "swiglu_oai"]
# "attn_mamba2": attention and a Mamba2 mixer side by side on the same normed input, their
# outputs summed (Falcon-H1's parallel hybrid)
Mixer = Literal["attn", "mamba", "mamba2", "shortconv", "attn_mamba2"]


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """What each block is made of; the defaults are Llama's.

    Block: h = x + post_attn_norm(attn(attn_norm(x))); out = h + post_ffn_norm(mlp(ffn_norm(h))),
    the post norms only with `post_norms`, the pre norms only with `pre_norms`;
    mlp(x) = w2(act(w1 x) * w3 x).
    """

    norm_shift: float = 0.0  # RMSNorm scales by (norm_shift + w): Gemma's (1 + w) is 1.0
    activation: Activation = "silu"  # of the gate: SiLU (SwiGLU) or tanh-GELU (GeGLU)
    qk_norm: bool = False  # RMSNorm over head_dim of each q and k head, before RoPE
    qk_norm_full: bool = False  # with qk_norm: over the whole q and k projections (OLMoE)
    post_norms: bool = False  # norms on the attention and MLP outputs (Gemma 2/3, OLMo 2)
    pre_norms: bool = True  # norms on the attention and MLP inputs (not OLMo 2, EXAONE 4.0)
    embed_scale: bool = False  # token embeddings times sqrt(dim), rounded to the model dtype


LLAMA = BlockSpec()


def periodic_windows(n_layers: int, window: int, period: int) -> tuple[int, ...]:
    """Per layer: `window` for the sliding-window layers, 0 for every `period`-th (global):
    llama.cpp's set_swa_pattern(period)."""
    return tuple(0 if (i + 1) % period == 0 else window for i in range(n_layers))


@dataclass(frozen=True, slots=True)
class MoEArgs:
    """A sparse mixture-of-experts MLP (model/layers/moe.py; transformers' Qwen3MoeSparseMoeBlock,
    llama.cpp's build_moe_ffn with softmax gating): p = softmax(router x) over n_experts; the
    n_used largest, divided by their sum when `norm_topk_prob`, weight the outputs of those
    experts, each a gated MLP of width `expert_dim`.
    gpt-oss (transformers' GptOssMLP, llama.cpp's SOFTMAX_WEIGHT gating): biases on the router
    and every expert linear; softmax over the top-k logits, which equals the top-k of the full
    softmax renormalized (norm_topk_prob); the "swiglu_oai" activation with `swiglu_limit`."""

    n_experts: int
    n_used: int  # experts per token (num_experts_per_tok, expert_used_count)
    expert_dim: int  # moe_intermediate_size, expert_feed_forward_length
    norm_topk_prob: bool
    bias: bool = False  # router and experts with biases (gpt-oss)
    # gpt-oss: gate = min(gate, limit), up = clamp(up, -limit, limit),
    # act = (up + 1) * gate * sigmoid(alpha * gate); llama.cpp fixes alpha 1.702 and limit 7.0
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # Qwen2-MoE: a shared expert (a gated MLP of width shared_dim, 0: none) that every row takes
    # beside its routed ones, its output times sigmoid(shared_gate . x) where `shared_gate`
    shared_dim: int = 0
    shared_gate: bool = False
    # LFM2-MoE (llama.cpp's SIGMOID gating with exp_probs_b): "sigmoid" scores each expert
    # sigmoid(router x) instead of the softmax; with `selection_bias` the top-k is chosen on
    # scores + a per-expert bias (moe_sel_b) but weighted by the scores alone; the weights (after
    # norm_topk_prob) times `weights_scale` (routed_scaling_factor, expert_weights_scale)
    gating: Literal["softmax", "sigmoid"] = "softmax"
    selection_bias: bool = False
    weights_scale: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.n_used <= self.n_experts:
            raise ValueError(
                f"{self.n_used} experts used a token of {self.n_experts} (must be 1 to all)"
            )


@dataclass(frozen=True, slots=True)
class MuP:
    """Falcon-H1's muP multipliers, folded into the weights when an HF folder is read (llama.cpp's
    converter folds the same into a GGUF): the attention input (wq, wk, wv) and wk again by `key`;
    wo by `attn_out`; ssm_in by `ssm_in` and its row blocks z, x, B, C, dt by `ssm_rows`; ssm_out
    by `ssm_out`; the MLP gate w1 by `gate` and w2 by `down`. The embedding and logit multipliers
    are ModelArgs.embed_mult and logits_scaling."""

    attn_in: float = 1.0
    key: float = 1.0
    attn_out: float = 1.0
    ssm_in: float = 1.0
    ssm_rows: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    ssm_out: float = 1.0
    gate: float = 1.0
    down: float = 1.0


@dataclass(frozen=True, slots=True)
class LongRope:
    """Phi-3's LongRoPE: per rotated pair, divisors of the inverse frequencies for contexts up to
    the original training context `n_ctx_orig` (short) and past it (long); both with the
    attention factor on cos and sin (RopeConfig.attn_factor)."""

    short: RopeConfig
    long: RopeConfig
    n_ctx_orig: int


@dataclass(frozen=True, slots=True)
class LayerDesc:
    """What one block computes (model/layers/decoder.py Block; model/runner/native.py's C++ step):

    h = x + m * [post_attn_norm](mixer(attn_norm(x)))
    out = h + m * [post_ffn_norm](w2(act(w1 f) * w3 f)), f = ffn_norm(h)   (only with `ffn`)
    `moe`: the MLP is ModelArgs.moe's mixture of experts (model/layers/moe.py) instead.

    mixer "attn": qkv = wqkv x [+ bqkv]; [q_norm, k_norm per head]; RoPE (`rope`; None: NoPE);
    K/V into the cells of the layer's pool (window 0: the full pool, W: the window's); attention
    over the cells the row may see (p - W, p], softmax of the scores s = scale q.k, capped to
    softcap * tanh(s / softcap) where softcap > 0 (Gemma 2), with `sinks` one more logit per
    head in the softmax's denominator that attends to nothing (gpt-oss); then wo [+ bo].
    mixer "mamba2": model/layers/mamba2.py over the sequence's state slot, "mamba" (Mamba 1)
    model/layers/mamba.py over it; "shortconv": LFM2's
    gated short convolution (model/layers/shortconv.py) over it. m = residual_mult. Without
    `pre_norms` attn_norm and ffn_norm are the identity (OLMo 2, EXAONE 4.0)."""

    mixer: Mixer
    window: int  # 0: full attention; W > 0 sees (p - W, p]
    rope: RopeConfig | None  # None: no position encoding (NoPE, and mamba2 layers)
    swa_rope: bool  # rotates with the sliding-window tables (ForwardBatch.rope_swa)
    scale: float  # softmax scale (0.0 on a mamba2 layer)
    softcap: float  # attention logit soft-capping (0.0: none)
    qkv_bias: bool
    out_bias: bool  # a bias on wo (gpt-oss)
    sinks: bool  # attention sinks: a learned logit per query head (gpt-oss)
    qk_norm: bool
    qk_norm_full: bool
    post_norms: bool
    pre_norms: bool
    ffn: bool
    moe: bool
    moe_bias: bool  # router and expert biases (MoEArgs.bias)
    moe_shared: bool  # a shared expert beside the routed ones (MoEArgs.shared_dim)
    moe_shared_gate: bool  # its output gated by sigmoid(shexp_gate . x) (MoEArgs.shared_gate)
    moe_selection_bias: bool  # the experts chosen on scores + moe_sel_b (MoEArgs.selection_bias)
    activation: Activation
    norm_shift: float
    residual_mult: float

    @property
    def weights(self) -> tuple[str, ...]:
        """The weight kinds this block reads (layers.{i}.<kind>)."""
        ffn = ["ffn_norm", "w1", "w3", "w2"] if self.ffn else []
        if self.ffn and self.moe:
            ffn = ["ffn_norm", "moe_router", "w1_exps", "w3_exps", "w2_exps"]
            if self.moe_bias:
                ffn += ["moe_router_b", "b1_exps", "b3_exps", "b2_exps"]
            if self.moe_shared:
                ffn += ["w1_shexp", "w3_shexp", "w2_shexp"]
            if self.moe_shared_gate:
                ffn.append("shexp_gate")
            if self.moe_selection_bias:
                ffn.append("moe_sel_b")
        if not self.pre_norms:
            ffn = [k for k in ffn if k != "ffn_norm"]
        mamba2 = ["ssm_in", "ssm_conv", "ssm_dt_b", "ssm_a", "ssm_d", "ssm_norm", "ssm_out"]
        if self.mixer == "mamba2":
            return tuple(["attn_norm", *mamba2, *ffn])
        if self.mixer == "mamba":
            kinds = ["attn_norm", "ssm_in", "ssm_conv", "ssm_x", "ssm_dt", "ssm_dt_b", "ssm_a"]
            return tuple([*kinds, "ssm_d", "ssm_out", *ffn])
        if self.mixer == "shortconv":
            return ("attn_norm", "shortconv_in", "shortconv_conv", "shortconv_out", *ffn)
        kinds = ["attn_norm", "wq", "wk", "wv", "wo", *ffn][0 if self.pre_norms else 1 :]
        if self.qkv_bias:
            kinds += ["bq", "bk", "bv"]
        if self.out_bias:
            kinds.append("bo")
        if self.sinks:
            kinds.append("sinks")
        if self.qk_norm:
            kinds += ["q_norm", "k_norm"]
        if self.post_norms:
            kinds += ["post_attn_norm", "post_ffn_norm"]
        if self.mixer == "attn_mamba2":
            kinds += mamba2
        return tuple(kinds)


@dataclass(slots=True)
class ModelArgs:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    norm_eps: float
    rope: RopeConfig  # of the full-attention layers (all layers without rope_swa)
    n_ctx_train: int
    qkv_bias: bool = False
    out_bias: bool = False  # wo with a bias (gpt-oss's attention_bias)
    attn_sinks: bool = False  # a learned sink logit per query head in every softmax (gpt-oss)
    block: BlockSpec = field(default_factory=BlockSpec)
    windows: tuple[int, ...] = ()  # per layer: 0 full attention, W > 0 sees (p - W, p]; () all 0
    rope_swa: RopeConfig | None = None  # RoPE of the sliding-window layers; None: `rope`
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    # Gemma 2's soft-capping: scores -> c * tanh(scores / c), logits -> c' * tanh(logits / c')
    attn_softcap: float = 0.0  # 0.0: none
    final_softcap: float = 0.0
    # LongRoPE (Phi-3): `rope` is longrope.short until use_context picks the long factors
    longrope: LongRope | None = None
    # recurrent and hybrid models (Mamba, Mamba2, Granite 4.0-H, LFM2): per layer "attn",
    # "mamba", "mamba2" or "shortconv" (() every layer attention), the Mamba2 or Mamba sizes,
    # and whether blocks have an MLP
    mixers: tuple[Mixer, ...] = ()
    ssm: SSMArgs | None = None
    mamba: MambaArgs | None = None
    ffn: bool = True  # False: Mamba2 (the block is h = x + mixer(norm(x)))
    short_conv: int = 0  # LFM2's "shortconv" layers: the kernel length L (conv_L_cache)
    nope: bool = False  # attention without any position encoding (Granite 4.0-H)
    nope_layers: tuple[bool, ...] = ()  # per layer: True skips RoPE there (SmolLM3's every 4th)
    # Granite scalars: x = embed * embed_mult; h = x + residual_mult * sublayer(..);
    # logits = output(h) / logits_scaling
    embed_mult: float = 1.0
    residual_mult: float = 1.0
    logits_scaling: float = 1.0
    mup: MuP | None = None  # Falcon-H1's multipliers (folded into an HF folder's weights)
    # mixture of experts: the experts' sizes, and per layer whether its MLP is the mixture
    # (() every layer; Qwen3-MoE's mlp_only_layers and decoder_sparse_step make dense ones)
    moe: MoEArgs | None = None
    moe_layers: tuple[bool, ...] = ()

    def use_context(self, n_ctx_seq: int) -> None:
        """Fix the RoPE for a context of `n_ctx_seq` tokens per sequence before a worker is
        built: LongRoPE's long factors past the original training context. K is stored rotated,
        so the choice is made once, as llama.cpp makes it per context (not per position)."""
        lr = self.longrope
        if lr is not None:
            self.rope = lr.long if n_ctx_seq > lr.n_ctx_orig else lr.short

    def is_moe(self, layer: int) -> bool:
        return self.moe is not None and (not self.moe_layers or self.moe_layers[layer])

    def mixer(self, layer: int) -> Mixer:
        return self.mixers[layer] if self.mixers else "attn"

    def has_attention(self, layer: int) -> bool:
        return self.mixer(layer) in ("attn", "attn_mamba2")

    def state_layer(self, layer: int) -> int:
        """Where a layer's recurrent state lives in the memory spec: its own index, or for the
        k-th parallel "attn_mamba2" layer (its K/V at its own index) n_layers + k."""
        if self.mixer(layer) != "attn_mamba2":
            return layer
        return self.n_layers + sum(self.mixer(i) == "attn_mamba2" for i in range(layer))

    def nope_layer(self, layer: int) -> bool:
        return bool(self.nope_layers) and self.nope_layers[layer]

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def rope_of(self, layer: int) -> RopeConfig:
        if self.rope_swa is not None and self.window(layer) > 0:
            return self.rope_swa
        return self.rope

    @property
    def layer_ropes(self) -> list[RopeConfig]:
        return [self.rope_of(i) for i in range(self.n_layers)]

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale

    def layer_desc(self, layer: int) -> LayerDesc:
        mixer, block = self.mixer(layer), self.block
        rope = self.rope_of(layer)
        return LayerDesc(
            mixer=mixer,
            window=self.window(layer),
            rope=None
            if self.nope or not self.has_attention(layer) or self.nope_layer(layer)
            else rope,
            swa_rope=rope is not self.rope,
            # a Mamba2 model has no head_dim
            scale=self.scale if self.has_attention(layer) else 0.0,
            softcap=self.attn_softcap,
            qkv_bias=self.qkv_bias,
            out_bias=self.out_bias,
            sinks=self.attn_sinks and mixer == "attn",
            qk_norm=block.qk_norm,
            qk_norm_full=block.qk_norm_full,
            post_norms=block.post_norms,
            pre_norms=block.pre_norms,
            ffn=self.ffn,
            moe=self.is_moe(layer),
            moe_bias=self.is_moe(layer) and self.moe is not None and self.moe.bias,
            moe_shared=self.is_moe(layer) and self.moe is not None and self.moe.shared_dim > 0,
            moe_shared_gate=self.is_moe(layer) and self.moe is not None and self.moe.shared_gate,
            moe_selection_bias=self.is_moe(layer)
            and self.moe is not None
            and self.moe.selection_bias,
            activation=block.activation,
            norm_shift=block.norm_shift,
            residual_mult=self.residual_mult,
        )

    @property
    def memory_spec(self) -> MemorySpec:
        """What each layer keeps per sequence (kvcache/spec.py): K/V of every token, read
        through the layer's window, or a recurrent state; a parallel "attn_mamba2" layer i keeps
        both, its state after the n_layers entries (state_layer)."""
        specs: list[AttentionSpec | RecurrentSpec] = []
        for i in range(self.n_layers):
            if self.has_attention(i):
                specs.append(AttentionSpec(self.n_kv_heads, self.head_dim, self.window(i)))
            else:
                specs.append(RecurrentSpec(self.state_shapes))
        parallel = sum(self.mixer(i) == "attn_mamba2" for i in range(self.n_layers))
        if parallel:
            specs += [RecurrentSpec(self.state_shapes)] * parallel
        return MemorySpec.of(specs)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """One sequence's (conv, ssm) state in a recurrent layer (kvcache/state_storage.py):
        Mamba2's, Mamba's, or LFM2's short conv: conv [dim, L - 1], oldest column first, and no
        ssm."""
        if self.ssm is not None:
            return self.ssm.state_shapes
        if self.mamba is not None:
            return self.mamba.state_shapes
        assert self.short_conv > 1, "a recurrent layer needs ModelArgs.ssm or short_conv"
        return ((self.dim, self.short_conv - 1), (0,))
