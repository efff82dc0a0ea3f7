"""The sparse mixture-of-experts MLP (model.arch.MoEArgs): Qwen3-MoE, OLMoE, Granite MoE, Mixtral,
gpt-oss, Qwen2-MoE, Granite 4.0-H's, LFM2-MoE.

Routing as transformers' Qwen3MoeTopKRouter and llama.cpp's build_moe_ffn (softmax gating):
logits = router x in the model dtype, p = softmax(logits) in float32, the top n_used of p
(divided by their sum with norm_topk_prob), cast back to the model dtype. LFM2-MoE (sigmoid
gating): p = sigmoid(logits) in float32, the top n_used of p + a selection bias, weighted by
their p (renormalized) times the routed scaling factor. Each expert is a gated
MLP w2(act(w1 x) * w3 x) on the shared Linear kinds (model/layers/ggml.py make_linear): float
weights, model/layers/quant.py's QuantLinear after `quantize`, or a GGUF's own blocks (one
expert's rows of the 3-D ffn_*_exps tensor, a view of the mapping). The router stays float:
llama.cpp's quantize keeps ffn_gate_inp unquantized too.

A step's rows are grouped by expert: every (row, slot) pair is sorted by its expert, so each
active expert runs once over all the rows routed to it (its weights read once per step), and
the weighted outputs are added back per row in ascending expert order (transformers' order).
A shared expert (Qwen2-MoE: transformers' Qwen2MoeSparseMoeBlock, llama.cpp's qwen2moe) runs on
every row after them, its output times sigmoid(shexp_gate . x), added last.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.arch import Activation, ModelArgs
from model.layers.blocks import FeedForward

# the top-k weights' sum is divided by at least this (llama.cpp's build_moe_ffn; the kernels'
# moe_route the same)
MIN_WEIGHT_SUM = 6.103515625e-5


class MoEFeedForward(nn.Module):
    """sum over the row's top-k experts e of weight_e * expert_e(x); `expert_rows` counts the
    (row, slot) pairs each expert took since the model was built (the expert load)."""

    def __init__(
        self,
        args: ModelArgs,
        weights: dict[str, Any],
        prefix: str,
        activation: Activation = "silu",
    ) -> None:
        super().__init__()
        moe = args.moe
        assert moe is not None, "a MoE layer needs ModelArgs.moe"
        self.n_experts, self.n_used = moe.n_experts, moe.n_used
        self.norm_topk_prob = moe.norm_topk_prob
        self.router = nn.Parameter(weights[prefix + "moe_router"], requires_grad=False)  # [E, d]
        self.router_bias = None  # [E] (gpt-oss)
        kinds = ["w1", "w3", "w2"] + (["b1", "b3", "b2"] if moe.bias else [])
        stacks = {k: weights[f"{prefix}{k}_exps"] for k in kinds}  # each indexable by expert
        if moe.bias:
            bias = weights[prefix + "moe_router_b"]
            self.router_bias = nn.Parameter(bias, requires_grad=False)
        self.sigmoid = moe.gating == "sigmoid"
        self.weights_scale = moe.weights_scale
        self.selection_bias: nn.Parameter | None = None  # [E] float32 (LFM2-MoE's expert_bias)
        if moe.selection_bias:
            sel = weights[prefix + "moe_sel_b"].float()
            self.selection_bias = nn.Parameter(sel, requires_grad=False)
        swiglu = (moe.swiglu_alpha, moe.swiglu_limit)
        self.experts = nn.ModuleList(
            FeedForward({k: w[e] for k, w in stacks.items()}, "", activation, swiglu)
            for e in range(self.n_experts)
        )
        self.register_buffer(
            "expert_rows", torch.zeros(self.n_experts, dtype=torch.int64), persistent=False
        )
        self.shared: FeedForward | None = None
        self.shared_gate: nn.Parameter | None = None  # [1, d]
        if moe.shared_dim:
            shared = {k: weights[f"{prefix}{k}_shexp"] for k in ("w1", "w3", "w2")}
            self.shared = FeedForward(shared, "", activation)
        if moe.shared_gate:
            gate = weights[prefix + "shexp_gate"].reshape(1, -1)
            self.shared_gate = nn.Parameter(gate, requires_grad=False)

    def route(self, x: torch.Tensor, fused: Any | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, d] -> (weights [n, k] in x's dtype, experts [n, k] int64); with the C++
        kernels their moe_route, which the one-call step calls too (the same experts and
        weights, bit for bit)."""
        bias = None if self.router_bias is None else self.router_bias.to(x.dtype)
        logits = F.linear(x, self.router.to(x.dtype), bias)  # [n, E]
        if fused is not None and hasattr(fused, "moe_route"):
            sel = self.selection_bias
            weights, experts = fused.moe_route(
                logits, self.n_used, self.norm_topk_prob, self.sigmoid, sel, self.weights_scale
            )
            return weights.to(x.dtype), experts
        if self.sigmoid:
            probs = torch.sigmoid(logits.float())
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if self.selection_bias is None:
            top, experts = torch.topk(probs, self.n_used, dim=-1)
        else:  # chosen on the biased scores, weighted by the scores
            experts = torch.topk(probs + self.selection_bias, self.n_used, dim=-1).indices
            top = probs.gather(1, experts)
        if self.norm_topk_prob:  # llama.cpp's clamp: k sigmoid scores can all underflow to 0
            top = top / top.sum(dim=-1, keepdim=True).clamp_min(MIN_WEIGHT_SUM)
        if self.weights_scale != 1.0:
            top = top * self.weights_scale
        return top.to(x.dtype), experts

    def forward(self, x: torch.Tensor, fused: Any | None = None) -> torch.Tensor:
        n, k = x.shape[0], self.n_used
        top, experts = self.route(x, fused)
        flat = experts.reshape(-1)  # [n * k]
        order = torch.argsort(flat, stable=True)  # (row, slot) pairs grouped by expert
        rows = order // k
        counts = torch.bincount(flat, minlength=self.n_experts)
        self.expert_rows += counts
        xs = x.index_select(0, rows)  # [n * k, d], expert by expert
        ys = torch.empty_like(xs)
        start = 0
        for e, count in enumerate(counts.tolist()):
            if count:
                ys[start : start + count] = self.experts[e](xs[start : start + count], fused)
                start += count
        ys *= top.reshape(-1).index_select(0, order)[:, None]
        out = x.new_zeros(n, x.shape[1]).index_add_(0, rows, ys)
        if self.shared is not None:
            shared = self.shared(x, fused)
            if self.shared_gate is not None:
                shared *= torch.sigmoid(F.linear(x, self.shared_gate.to(x.dtype)))
            out += shared
        return out


def expert_load(model: nn.Module) -> list[list[int]]:
    """Per MoE layer (in order), the (row, slot) pairs each expert took so far; [] for a dense
    model. Read from another thread while steps run: each layer's counts are one copy."""
    return [m.expert_rows.tolist() for m in model.modules() if isinstance(m, MoEFeedForward)]
