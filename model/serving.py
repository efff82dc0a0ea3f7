"""open_model: everything model/ does before a worker exists, decided once and logged.

The device (`resolve_device`), the runtime (activation dtype and weight format for this CPU),
the load, the quantization, the C++ kernels for this CPU's ISA level, and the context a
sequence gets (`fit_context`). server/model_backend.py composes the result with the
scheduler's memory and a worker (model.runner.worker.make_worker).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from model.errors import ModelLoadError
from model.kernels import isa, kernel_status, load_kernels
from model.layers.quant import quantize
from model.load.loader import (
    LoadedModel,
    Runtime,
    block_servable,
    choose_runtime,
    default_model_path,
    load_model,
)

log = logging.getLogger("cellserve.model")


@dataclass(slots=True)
class OpenModel:
    loaded: LoadedModel
    runtime: Runtime
    device: str
    isa: str  # the ISA path steps take ("" off the CPU)
    cpu_isa: str  # what this CPU can run ("" off the CPU)
    kernels: str  # the C++ build's level, or "none"


def resolve_device(device: str) -> str:
    """ "auto": CUDA where torch sees a GPU, else the CPU; any other name as given."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def fit_context(
    loaded: LoadedModel, ctx_per_seq: int, n_cells: int, who: str = "the model's"
) -> int:
    """A sequence's context: --ctx-per-seq within the cache, with a warning past `who`
    training context; the model's context-dependent factors (LongRoPE's) set for it before a
    worker is made."""
    n_ctx = min(ctx_per_seq, n_cells)
    if n_ctx > loaded.config.n_ctx_train > 0:
        log.warning(
            "ctx_per_seq %d is past %s training context %d",
            n_ctx,
            who,
            loaded.config.n_ctx_train,
        )
    loaded.config.use_context(n_ctx)
    return n_ctx


def open_model(
    path: str | Path | None,
    device: str,
    dtype: str | None = None,
    quant: str | None = None,
    chat_template: str | None = None,
    head_rows: int | None = None,
) -> OpenModel:
    """Load `path` (default: the embedded model) for `device`; `dtype` / `quant` None: the fast
    setup for this machine (choose_runtime). `head_rows`: the output head projects onto token
    ids below it only (Transformer.keep_head_rows: a draft model's reduced vocabulary; None or
    at least the vocabulary: all of them)."""
    path = path or default_model_path()
    runtime = choose_runtime(path, device, dtype, quant)
    if runtime.quant == "gguf":
        ok, why = block_servable(path) if device == "cpu" else (False, f"{device} device")
        if not ok:
            raise ModelLoadError(f"{path}: --quant gguf cannot serve it: {why}.")
    loaded = load_model(
        path,
        dtype=runtime.dtype,
        device=device,
        chat_template=chat_template,
        blocks=runtime.quant == "gguf",
    )
    if loaded.chat_template is None:
        log.warning("the model has no chat template: /v1/chat/completions answers 400")
    if head_rows is not None and head_rows < loaded.config.vocab_size:
        loaded.transformer.keep_head_rows(head_rows)  # before quantize: only those rows are
    if runtime.quant != "none":
        quantize(loaded.transformer, runtime.quant)
    kernels, active, detected = "none", "", ""
    if device == "cpu":
        load_kernels()
        status = kernel_status()
        kernels = status.level or "none"
        cpu = isa.describe()
        active, detected = cpu["active"], cpu["detected"]
        forced = f", {isa.ENV}={cpu['forced']}" if cpu["forced"] else ""
        log.info(
            "CPU: %s (%s%s); ISA path %s; C++ kernels: %s",
            cpu["cpu"],
            detected,
            forced,
            active,
            status.reason,
        )
    log.info(
        "running %s activations, %s weights: %s%s",
        runtime.dtype,
        {"none": "unquantized", "gguf": "the GGUF's own block"}.get(runtime.quant, runtime.quant),
        runtime.reason,
        "" if runtime.quant == "none" else " (outputs differ slightly from the unquantized model)",
    )
    return OpenModel(loaded, runtime, device, active, detected, kernels)
