"""Build the real Backend: load the model, make the worker and its KV cache, start nothing yet."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.stats import StepStats
from server.backend import Backend
from server.settings import Settings

log = logging.getLogger("cellserve.server")


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_backend(
    settings: Settings,
    on_step: Callable[[StepStats], None],
    wrap_worker: Callable[[Any], Any] | None = None,
) -> Backend:
    """`wrap_worker` (tests only) wraps the worker the engine drives."""
    import torch

    from model import default_model_path, load_model
    from model.quant import quantize

    # NOTE: load on one thread; the worker takes its threads in the engine thread (see
    # model.worker.set_torch_threads: OpenMP teams opened here would slow every step).
    threads = settings.threads or os.cpu_count() or 1
    torch.set_num_threads(1)
    device = resolve_device(settings.device)
    dtype = settings.dtype or ("float32" if device == "cpu" else "bfloat16")
    path = settings.model or default_model_path()
    loaded = load_model(path, dtype=dtype, device=device)
    if settings.quant != "none":
        quantize(loaded.transformer, settings.quant)
        log.warning(
            "--quant %s: weights are quantized; outputs differ slightly from the unquantized model",
            settings.quant,
        )
    log.info("torch threads: %d (model steps)", threads)
    n_ctx = min(settings.ctx_per_seq, settings.n_cells)
    if n_ctx > loaded.config.n_ctx_train > 0:
        log.warning(
            "ctx_per_seq %d is past the model's training context %d",
            n_ctx,
            loaded.config.n_ctx_train,
        )
    from model.worker import make_worker

    worker = make_worker(
        loaded,
        settings.n_cells,
        dtype,
        device,
        batch_invariant=settings.batch_invariant,
        threads=threads if device == "cpu" else None,
    )
    if wrap_worker is not None:
        worker = wrap_worker(worker)
    config = EngineConfig(
        n_cells=settings.n_cells,
        n_seq_max=settings.n_seq_max,
        n_batch=settings.n_batch,
        n_ctx_seq=n_ctx,
        context_shift=settings.context_shift,
        max_queue=settings.max_queue,
        prefix_cache=settings.prefix_cache,
    )
    config.validate()
    from model.grammar import GrammarCompiler

    return Backend(
        engine=Engine(worker, config, on_step=on_step),
        tokenizer=loaded.tokenizer,
        chat_template=loaded.chat_template,
        model_name=settings.served_model_name or loaded.name,
        n_ctx_seq=n_ctx,
        n_cells=settings.n_cells,
        cache_bytes=worker.kv_bytes_per_cell * settings.n_cells,
        embedding_dim=loaded.config.dim,
        grammars=GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size),
    )
