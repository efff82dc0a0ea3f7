"""The cache geometry a router reads, as vLLM's `vllm:cache_config_info` labels.

cellserve's cache is cells (one token each), not vLLM's fixed blocks. A router that scores
prefixes in blocks (llm-d's `tokenProcessorConfig.blockSize`, vllm-router's
`--kv-event-block-size`) is told `block_size` = `--kv-events-block-size` (default 16):
every `block_size` consecutive positions of a cached prompt are one virtual block, and
`num_gpu_blocks` = cells of the full-attention pool // block_size (how many such blocks
fit). `cache_dtype` is how the K/V rows are stored: the cache type (--cache-type-k /
--cache-type-v, "q8_0" or "q8_0/f16" where they differ), else the model's dtype.
"""

from __future__ import annotations

from server.backend import Backend
from server.settings import Settings


def cache_config_labels(backend: Backend, settings: Settings) -> dict[str, str]:
    block_size = settings.kv_events_block_size
    return {
        "block_size": str(block_size),
        "num_gpu_blocks": str(backend.n_cells // block_size),
        "num_cpu_blocks": "0",
        "cache_dtype": _cache_dtype(backend.runtime),
        "enable_prefix_caching": str(settings.prefix_cache),
        "n_cells": str(backend.n_cells),
    }


def _cache_dtype(runtime: dict[str, str]) -> str:
    k, v = runtime.get("cache_type_k"), runtime.get("cache_type_v")
    if not k or not v:
        return runtime.get("dtype", "auto")
    return k if k == v else f"{k}/{v}"
