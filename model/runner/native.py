"""The layers of a step in one C++ call (model/kernels step_layers, step.cpp).

A step through the Python layers is ~1,000 small torch calls; from Python each costs a few
microseconds more than the op itself. For int4 or int8 models with bfloat16 activations (the
AVX-512 BF16 default) or float32 ones (the default elsewhere, e.g. AVX2) the C++ side runs each
block as its model.arch.LayerDesc says, the description model/layers/decoder.py's Block is built
from: the norms, q/k norms, biases, RoPE table, window and MLP activation it names, read from the
Block's own modules (`StepLayer`), with the same ops in the same order (the quantized GEMMs, the
fused RMSNorm / SiLU-mul / RoPE kernels the Python layers call too through ForwardBatch.fused,
the attention kernels, and raw passes for the K/V writes and residual adds that give torch's
bits), so the logits equal the Python path's bit for bit: tests/model/test_native.py, for
Llama (SmolLM2), Qwen2 (q/k/v biases) and Gemma 3 (q/k norms, post norms, GeGLU, sliding
windows over their own pool, two RoPE bases), and the mixture-of-experts MLP (step.cpp
moe_ffn, as model/layers/moe.py) and OLMoE's q/k norms over the whole projection
(tests/model/test_moe.py); tests/model/test_dense_families.py for Gemma 2 (scores capped in
the attention kernels), OLMo 2 and EXAONE 4.0 (no pre-norms: StepLayer's attn_norm / ffn_norm
None), GLM-4 and partial Phi-3 (RoPE on part of each head, GLM's pairs interleaved:
step.cpp rope_partial_, the Python layers' ATen ops). An architecture described in
model/arch/ runs here without C++ of its own; the recurrent mixers through the C++ ops the
Python layers call too (LFM2's short_conv, Mamba2's mamba2_mix, Mamba's mamba_mix, over
ForwardBatch.state). It
takes decode steps, prompt chunks and steps that mix both, wherever every attention group of
every window has the C++ kernels' cells and lens (the prompt kernel: float32 with AVX2,
bfloat16 with AVX-512 BF16; a window's prompt chunks with each row's first cell) and covers
its rows.
Each linear runs through the kernels' quant_linear (step.cpp), which QuantLinear.forward calls
too, as the kind QuantLinear.step_kind (BlockLinear.step_kind: "ggml") names for the model's
dtype, with the StepLinear its step_linear builds (int4: torch's for bfloat16 activations,
model/kernels/int4.cpp up to small_rows float32 rows and gemm.cpp past them; q8 with float32
activations: int8.cpp; int8: torch's; past small_rows the dense copy, oneDNN-packed where it
can). A linear without a kind for the model's dtype keeps the model in Python.
Decode steps, int4 + bfloat16, 300 cached tokens, native vs Python (before the packed weights
and the fused kernels): 8.1 vs 11.8 ms at 1 sequence, 12.5 vs 16.0 at 2, 18.2 vs 23.3 at 4,
30.6 vs 33.7 at 8. Taking the per-layer ATen calls out (in-place RoPE, raw K/V copies,
in-place adds, reused buffers; ~20 calls a layer before) cut the step at 300 cached tokens by
~8% (AVX2, float32: 8.5 -> 7.8 ms at 1 sequence, 87 -> 81 at 32) and 7-14% (AVX-512 BF16:
10.6 -> 9.1 ms, 43 -> 40 at 32), best of 25 interleaved runs on a loaded 2-core Zen 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvcache.storage import GroupedKVStorage, KVStorage
from model.arch import ModelArgs
from model.layers.batch import DecodeGroup, PromptGroup
from model.layers.decoder import Attention, Block, ForwardBatch, Transformer
from model.layers.ggml import BlockLinear
from model.layers.lora import unwrap
from model.layers.mamba import MambaMixer
from model.layers.mamba2 import Mamba2Mixer
from model.layers.moe import MoEFeedForward
from model.layers.quant import INT4_GROUP, QuantLinear
from model.layers.shortconv import ShortConvMixer

# The work a step may do with the GIL held: the 1.5B's 64-row decode step (Qwen2.5-1.5B, 1.31G
# multiply-adds a row in its layers), the one measured (model/kernels/bindings.cpp). A model 5x
# the size keeps it for 12 rows, so that no step holds the interpreter for seconds
# (an 8B's 64-stream step would); smaller ones stop at STEP_GIL_ROWS.
STEP_GIL_MACS = 85_000_000_000  # 64 rows of the 1.5B and a little
STEP_GIL_ROWS = 64


def step_gil_rows(args: ModelArgs) -> int:
    """The most rows of a step that keeps the GIL (step_layers' gil_rows): STEP_GIL_MACS of
    the layers' linears (a MoE layer: its router and the experts a row uses), at most
    STEP_GIL_ROWS, at least 1."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    attn = 2 * args.dim * q + 2 * args.dim * kv
    macs = 0
    for i in range(args.n_layers):
        desc = args.layer_desc(i)
        mixer = attn
        if desc.mixer == "shortconv":
            mixer = 4 * args.dim * args.dim
        elif desc.mixer in ("mamba2", "attn_mamba2"):
            assert args.ssm is not None
            mamba2 = args.dim * (args.ssm.d_in_proj + args.ssm.d_inner)
            mixer = mamba2 if desc.mixer == "mamba2" else attn + mamba2
        elif desc.mixer == "mamba":
            assert args.mamba is not None
            mixer = args.dim * 3 * args.mamba.d_inner
        mlp = 3 * args.dim * args.hidden_dim if desc.ffn else 0
        if args.is_moe(i):
            assert args.moe is not None
            moe = args.moe
            mlp = args.dim * moe.n_experts + moe.n_used * 3 * args.dim * moe.expert_dim
        macs += mixer + mlp
    return max(1, min(STEP_GIL_ROWS, STEP_GIL_MACS // max(1, macs)))


@dataclass(slots=True)
class NativeDecoder:
    """Each block as a kernels.StepLayer for step_layers; `build` says whether a model
    qualifies."""

    kernels: Any  # the model.kernels module
    layers_: list[Any]  # kernels.StepLayer per block
    windows: list[int]  # the step's StepGroups, in order: one per window (0: full attention)
    swa_rope: bool  # the sliding-window layers rotate with ForwardBatch.rope_swa
    n_heads: int
    eps: float
    scale: float
    gil_rows: int  # steps of at most this many rows keep the GIL (step_gil_rows)
    recurrent: bool = False  # recurrent layers (LFM2, Mamba2): steps read ForwardBatch.state

    @staticmethod
    def build(
        model: Transformer, storage: KVStorage | GroupedKVStorage, kernels: Any
    ) -> tuple[NativeDecoder | None, str]:
        """The model's blocks as StepLayers, or None and the reason it does not qualify."""
        args = model.args
        if kernels is None:
            return None, "no C++ kernels"
        if model.dtype not in (torch.bfloat16, torch.float32) or storage.dtype != model.dtype:
            return None, f"{model.dtype} model over {storage.dtype} cells"
        if not storage.native and not getattr(kernels, "reads_cache_types", lambda: False)():
            return None, "cells of another cache type (a build without cache types)"
        rotated = bool(getattr(storage, "rot_k", 0) or getattr(storage, "rot_v", 0))
        if rotated and not hasattr(kernels.StepLayer(), "k_center"):
            return None, "rotated quantized cells (kvcache/rotation.py): a build without them"
        blocks: list[Block] = list(model.layers)  # type: ignore[arg-type]
        descs = [b.desc for b in blocks]
        parallel = any(d.mixer == "attn_mamba2" for d in descs)
        if parallel and not hasattr(kernels.StepLayer(), "ssm_in"):
            return None, "parallel attention + Mamba2 layers (Falcon-H1): a build without them"
        if any(d.activation == "swiglu_oai" and not d.moe for d in descs):
            return None, "a dense MLP with the clamped SwiGLU (step.cpp: the experts' only)"
        if any(d.rope is not None and d.rope.dim % 2 for d in descs):
            return None, "RoPE over an odd number of dims"
        linears = [m for b in blocks for m in _linears(b)]
        if not all(_step_kind(m, model.dtype) for m in linears):
            return None, "a linear without a C++ kind (float weights: the float32 reference)"
        ops = {
            "mamba": "mamba_mix",
            "mamba2": "mamba2_mix",
            "attn_mamba2": "mamba2_mix",
            "shortconv": "short_conv",
        }
        if any(d.mixer != "attn" for d in descs):
            for op in sorted({ops[d.mixer] for d in descs if d.mixer != "attn"}):
                if not hasattr(kernels, op):
                    return None, f"recurrent layers: a build without {op}"
            held = getattr(storage, "state", None)
            if held is None or held.dtype != model.dtype:
                return None, "recurrent layers over a conv state of another dtype"
            mamba2s = [b.mixer for b in blocks if isinstance(b.mixer, Mamba2Mixer)]
            mamba2s += [b.ssm_mixer for b in blocks if b.ssm_mixer is not None]
            if not all(m.kernel_takes(kernels) for m in mamba2s):
                return None, "a Mamba2 norm variant this build's mamba2_mix lacks"
            mambas = [b.mixer for b in blocks if isinstance(b.mixer, MambaMixer)]
            if not all(m.kernel_takes(kernels, held.dtype) for m in mambas):
                return None, "Mamba layers past mamba_mix's limits (d_conv >= 2, d_state <= 256)"
        windows = sorted({d.window for d in descs if d.mixer in ("attn", "attn_mamba2")})
        layers = []
        state: Any = getattr(storage, "state", None)  # checked above (recurrent models)
        for i, (block, desc) in enumerate(zip(blocks, descs, strict=True)):
            layer = kernels.StepLayer()
            mixer, ffn = block.mixer, block.feed_forward
            for name, norm in (  # the optional ones: None where the description has none
                ("attn_norm", block.attention_norm),
                ("ffn_norm", block.ffn_norm),
                ("post_attn_norm", block.post_attention_norm),
                ("post_ffn_norm", block.post_ffn_norm),
            ):
                setattr(layer, name, None if norm is None else norm.weight.detach())
            layer.residual_mult = desc.residual_mult
            linears = [_step_linear(kernels, lin, model.dtype) for lin in _linears(block)]
            layer.wqkv, layer.wo = linears[:2]  # the mixer's two linears
            first = 2  # the MLP's linears start after the mixers'
            if block.ssm_mixer is not None:  # step.cpp: mamba2_mix beside the attention
                layer.ssm_in, layer.ssm_out = linears[2:4]
                layer.mamba2 = block.ssm_mixer.native_params(kernels)
                slot = block.state_layer
                layer.conv_state, layer.ssm_state = state.conv(slot), state.ssm(slot)
                first = 4
            layer.ffn = ffn is not None
            if isinstance(ffn, MoEFeedForward):  # step.cpp moe_ffn
                layer.router = ffn.router.detach().to(model.dtype)
                layer.expert_rows = ffn.expert_rows
                n = first + 2 * len(ffn.experts)
                layer.experts_w13, layer.experts_w2 = linears[first:n:2], linears[first + 1 : n : 2]
                if ffn.shared is not None:  # step.cpp: w13 / w2 are the shared expert's
                    layer.shared_expert = True
                    layer.w13, layer.w2 = linears[n:]
                if ffn.shared_gate is not None:
                    layer.shexp_gate = ffn.shared_gate.detach().to(model.dtype)
                layer.n_used, layer.norm_topk = ffn.n_used, ffn.norm_topk_prob
                layer.sigmoid_gating, layer.weights_scale = ffn.sigmoid, ffn.weights_scale
                if ffn.selection_bias is not None:
                    layer.selection_bias = ffn.selection_bias.detach()
                if ffn.router_bias is not None:
                    layer.router_bias = ffn.router_bias.detach().to(model.dtype)
                if desc.activation == "swiglu_oai":
                    expert: Any = ffn.experts[0]
                    layer.swiglu_alpha, layer.swiglu_limit = expert.swiglu
            elif ffn is not None:
                layer.w13, layer.w2 = linears[first:]
            layer.gelu = desc.activation == "gelu_tanh"
            if isinstance(mixer, ShortConvMixer):  # step.cpp: short_conv between the linears
                layer.shortconv = True
                layer.conv_w = mixer.conv_w.detach()
                layer.conv_state = state.conv(i)
            elif isinstance(mixer, Mamba2Mixer):  # step.cpp: mamba2_mix between the linears
                layer.mamba2 = mixer.native_params(kernels)
                layer.conv_state, layer.ssm_state = state.conv(i), state.ssm(i)
            elif isinstance(mixer, MambaMixer):  # step.cpp: mamba_mix between the linears
                layer.mamba = mixer.native_params(kernels)
                layer.conv_state, layer.ssm_state = state.conv(i), state.ssm(i)
            else:
                assert isinstance(mixer, Attention)
                layer.q_norm = None if mixer.q_norm is None else mixer.q_norm.weight.detach()
                layer.k_norm = None if mixer.k_norm is None else mixer.k_norm.weight.detach()
                layer.k_cache, layer.v_cache = storage.k[i], storage.v[i]
                layer.head_dim = args.head_dim
                layer.groups = windows.index(desc.window)
                layer.rope = -1 if desc.rope is None else int(desc.swa_rope)
                if desc.rope is not None:  # GLM-4: half of each head, pairs interleaved
                    layer.rope_dim = desc.rope.dim
                    layer.rope_interleaved = desc.rope.layout == "interleaved"
                layer.softcap = desc.softcap
                layer.sinks = mixer.sinks
                if rotated:  # kvcache/rotation.py: the cells hold H (k - c) / H v
                    layer.rot_k, layer.rot_v = storage.rot_k, storage.rot_v
                    layer.k_center = storage.k_center(i, model.dtype)
            layers.append(layer)
        decoder = NativeDecoder(
            kernels,
            layers,
            windows,
            any(d.swa_rope for d in descs),
            args.n_heads,
            args.norm_eps,
            args.scale if args.n_kv_heads else 1.0,  # no attention layer: unused
            step_gil_rows(args),
            any(d.mixer != "attn" for d in descs),
        )
        return decoder, f"{len(layers)} blocks, {model.dtype}"

    def runs(self, batch: ForwardBatch) -> bool:
        """Every attention group of every window kernel-ready (cells and lens set; prompts only
        where the prompt kernel runs), each window's together covering the batch's rows; no
        LoRA rows (step.cpp has no low-rank delta: model/layers/lora.py); recurrent rows only
        for the short-convolution layers this decoder has."""
        if batch.lora is not None or (batch.state is not None) != self.recurrent:
            return False
        n = batch.tokens.shape[0]
        for window in self.windows:
            if window and window not in batch.windowed:
                return False
            decodes, prompts = batch.groups(window)
            covered = 0
            for g in decodes:
                if g.lens is None or g.cells is None:
                    return False
                covered += n if g.rows is None else g.rows.shape[0]
            for p in prompts:
                if p.lens is None or p.cells is None:
                    return False
                covered += p.end - p.start
            if covered != n:
                return False
        return True

    def layers(self, x: torch.Tensor, batch: ForwardBatch, storage: Any) -> torch.Tensor:
        groups = [self._groups(batch, w) for w in self.windows]
        ropes = [batch.rope_c, batch.rope_s]
        if self.swa_rope:
            assert batch.rope_swa is not None, "the worker builds rope_swa for rope_swa models"
            ropes += list(batch.rope_swa)
        out: torch.Tensor = self.kernels.step_layers(
            x,
            self.layers_,
            groups,
            ropes,
            self.n_heads,
            self.eps,
            self.scale,
            INT4_GROUP,
            self.gil_rows,
            None if batch.state is None else batch.state.native_state(self.kernels),
        )
        return out

    def _groups(self, batch: ForwardBatch, window: int) -> Any:
        decodes: list[DecodeGroup]
        prompts: list[PromptGroup]
        decodes, prompts = batch.groups(window)
        g = self.kernels.StepGroups()
        g.write_cells = batch.write_cells(window)
        g.decode_rows = [_EVERY_ROW if d.rows is None else d.rows for d in decodes]
        g.decode_cells = [d.cells for d in decodes]
        g.decode_lens = [d.lens for d in decodes]
        g.prompt_bounds = [b for p in prompts for b in (p.start, p.end)]
        g.prompt_cells = [p.cells for p in prompts]
        g.prompt_lens = [p.lens for p in prompts]
        g.prompt_firsts = [_FROM_0 if p.firsts is None else p.firsts for p in prompts]
        return g


_EVERY_ROW = torch.empty(0, dtype=torch.int64)  # step_layers: a decode group of every row
_FROM_0 = torch.empty(0, dtype=torch.int64)  # step_layers: a chunk whose rows see from cell 0


def _linears(block: Block) -> tuple[Any, ...]:
    """The block's linears: the mixer's two (attention's wqkv and wo, a recurrent mixer's
    in_proj and out_proj; a parallel layer's Mamba2 in_proj and out_proj after its attention's),
    then the MLP's (a MoE layer's: every expert's gate|up and down, then
    its shared expert's; none
    without an MLP half); a LoRA-adapted one's base (steps with LoRA rows take the Python
    layers: NativeDecoder.runs)."""
    a, f = block.mixer, block.feed_forward
    mixer: tuple[Any, ...] = (a.wqkv, a.wo) if isinstance(a, Attention) else (a.in_proj, a.out_proj)
    if block.ssm_mixer is not None:  # Falcon-H1: the Mamba2 mixer's two after the attention's
        mixer = (*mixer, block.ssm_mixer.in_proj, block.ssm_mixer.out_proj)
    if f is None:
        return tuple(map(unwrap, mixer))
    if isinstance(f, MoEFeedForward):
        experts = (lin for e in [*f.experts, *filter(None, [f.shared])] for lin in (e.w13, e.w2))
        return (*map(unwrap, mixer), *experts)
    return (*map(unwrap, mixer), unwrap(f.w13), unwrap(f.w2))


def _step_kind(lin: Any, dtype: torch.dtype) -> str | None:
    """The kind step_layers runs `lin` as, None where it cannot (float weights)."""
    if isinstance(lin, (QuantLinear, BlockLinear)):
        return lin.step_kind(dtype)
    return None


def _step_linear(kernels: Any, lin: QuantLinear | BlockLinear, dtype: torch.dtype) -> Any:
    return lin.step_linear(kernels, dtype)
