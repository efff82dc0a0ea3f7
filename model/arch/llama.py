"""Llama (and Mistral's HF configs; llama.cpp converts both to `llama`): the default block."""

from __future__ import annotations

from model.arch.args import LLAMA
from model.arch.family import Family

FAMILY = Family(arch="llama", model_types=("llama", "mistral"), block=LLAMA, gguf_permuted_qk=True)
