"""Qwen2 / Qwen2.5: Llama's block with q/k/v biases always (transformers' Qwen2Attention)."""

from __future__ import annotations

from model.arch.family import Family

FAMILY = Family(arch="qwen2", model_types=("qwen2",), qkv_bias=True)
