"""The Backend of an encoder embedding model (BERT, EmbeddingGemma): the same engine and
scheduler as a generative model, driving model.runner.encoder_worker.EncoderWorker.

Each step the scheduler packs whole inputs of any number of /v1/embeddings requests (up to
n_batch tokens) into one forward (EngineConfig.whole_prompts: no chunks, no prefix cache, no
context shift). The memory's cells are bookkeeping for one step: an embedding request releases
them when it finishes, in the step that read it. The generation endpoints answer 400
(Backend.task "embed").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.stats import StepStats
from server.backend import Backend
from server.settings import Settings

log = logging.getLogger("cellserve.server")


def load_encoder_backend(
    settings: Settings,
    path: str | Path,
    served_name: str | None,
    on_step: Callable[[StepStats], None],
    wrap_worker: Callable[[Any], Any] | None = None,
) -> Backend:
    """`served_name`: the name of a packaged model (else the folder / file name)."""
    import torch

    from model.errors import ModelLoadError
    from model.load.encoder import load_encoder
    from model.runner.encoder_worker import EncoderWorker
    from model.serving import resolve_device

    if settings.quant not in (None, "none"):
        raise ModelLoadError(f"{path}: --quant {settings.quant}: an encoder runs unquantized.")
    if settings.spec_kind != "none":
        raise ModelLoadError(f"{path}: an embedding model generates nothing to speculate on.")
    threads = settings.threads or os.cpu_count() or 1
    torch.set_num_threads(1)  # NOTE: the worker takes its threads in the engine thread
    device = resolve_device(settings.device)
    # NOTE: float32 unless --dtype: encoders are small and the vectors are compared by cosine
    dtype = settings.dtype or "float32"
    loaded = load_encoder(path, dtype, device)
    args = loaded.config
    n_ctx = min(settings.ctx_per_seq, settings.n_cells, args.n_ctx)
    if settings.n_batch < n_ctx:
        raise ModelLoadError(
            f"{path}: an encoder reads each input whole in one step; --n-batch {settings.n_batch} "
            f"is below its context of {n_ctx} tokens."
        )
    config = EngineConfig(
        n_cells=settings.n_cells,
        n_seq_max=settings.n_seq_max,
        n_batch=settings.n_batch,
        n_ctx_seq=n_ctx,
        context_shift=False,
        max_queue=settings.max_queue,
        prefix_cache=False,
        whole_prompts=True,
    )
    config.validate()
    memory = config.make_memory()
    log.info(
        "encoder %s: %d layers, %d dims%s, %s pooling%s, inputs up to %d tokens, %s on %s",
        args.arch,
        args.n_layers,
        args.dim,
        f" (Matryoshka: {loaded.matryoshka.describe(args.dim)})" if loaded.matryoshka else "",
        args.pooling,
        ", L2-normalised" if args.normalize else "",
        n_ctx,
        dtype,
        device,
    )
    worker: Any = EncoderWorker(loaded.encoder, threads if device == "cpu" else None)
    if wrap_worker is not None:
        worker = wrap_worker(worker)
    owned = sum(b.numel() * b.element_size() for b in loaded.encoder.buffers())
    return Backend(
        engine=Engine(worker, config, on_step=on_step, memory=memory),
        tokenizer=loaded.tokenizer,
        chat_template=None,
        model_name=settings.served_model_name or served_name or loaded.name,
        n_ctx_seq=n_ctx,
        n_cells=settings.n_cells,
        cache_bytes=0,
        embedding_dim=args.dim,
        runtime={
            "device": device,
            "isa": "",
            "cpu_isa": "",
            "kernels": "none",
            "native_step": "no",
            "dtype": dtype,
            "quant": "none",
        },
        weights_owned_bytes=owned,
        task="embed",
        embedding_normalize=args.normalize,
        embedding_matryoshka=loaded.matryoshka,
    )
