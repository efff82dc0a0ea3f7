"""Qwen3: Llama's block with an RMSNorm over each q and k head before RoPE, no q/k/v biases."""

from __future__ import annotations

from model.arch.args import BlockSpec
from model.arch.family import Family

BLOCK = BlockSpec(qk_norm=True)
FAMILY = Family(arch="qwen3", model_types=("qwen3",), block=BLOCK)
