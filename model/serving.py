"""open_model: everything model/ does before a worker exists, decided once and logged.

The runtime (activation dtype and weight format for this CPU), the load, the quantization, and
the C++ kernels for this CPU's ISA level. server/model_backend.py composes the result with the
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


def open_model(
    path: str | Path | None,
    device: str,
    dtype: str | None = None,
    quant: str | None = None,
    chat_template: str | None = None,
) -> OpenModel:
    """Load `path` (default: the embedded model) for `device`; `dtype` / `quant` None: the fast
    setup for this machine (choose_runtime)."""
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
