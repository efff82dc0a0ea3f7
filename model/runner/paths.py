"""Which parts of a step run in C++, decided once per model when its worker is built.

Three choices, each with the reason a start-up log line gives, and what the linears run:
- the one-call step (model/runner/native.py): every block of a step in one C++ call;
- the attention kernels (model/kernels attention*.cpp): decode rows always when the cache has
  the model's dtype, prompt chunks where this CPU's build has the kernel for that dtype and the
  head shape fits it (soft-capped scores too: Gemma 2's cap is the kernels' `softcap`; gpt-oss's
  attention sinks their `sinks`);
- the fused RMSNorm / SiLU-mul / RoPE: bfloat16 models, and float32 ones that the one-call step
  runs (the Python layers must then compute the same as the C++ step);
- the linears, by kind (counted once here: a linear's kernel is fixed by its weights and the
  model's dtype; the row count then picks the micro-kernel inside it, as llama.cpp's does):
  a GGUF's own blocks on ggml_linear, cellserve's int4 / int8 / q8 on quant_linear, or torch.
Everything not chosen here runs torch. Per step, the worker only asks whether the step's rows
are kernel-ready (`NativeDecoder.runs`); it never re-decides a path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvcache.storage import GroupedKVStorage, KVStorage
from model.layers.blocks import Linear
from model.layers.decoder import Transformer
from model.layers.ggml import GGML_TYPE_NAMES, BlockLinear
from model.layers.quant import QuantLinear
from model.runner.native import NativeDecoder

PROMPT_KERNEL_MAX_HEAD_DIM = 256
PROMPT_KERNEL_MAX_GQA = 16  # query heads per K/V head


@dataclass(slots=True)
class KernelPaths:
    """The kernels a worker's steps take; None = torch. `why`: per path, the reason."""

    native: NativeDecoder | None = None
    decode_attention: Any | None = None  # kernels.decode_attention
    prompt_attention: Any | None = None  # kernels.prompt_attention
    fused: Any | None = None  # the kernels module, for ForwardBatch.fused
    why: dict[str, str] = field(default_factory=dict)
    # how many linears run each way, e.g. {"C++ ggml_linear Q4_K": 168, "torch": 1}
    linears: dict[str, int] = field(default_factory=dict)
    # whether the K-quant linears' prompt chunks run on AMX tiles (model/kernels/ggml_kamx.h)
    amx: bool = False

    def describe(self) -> str:
        """One line for the start-up log: each path, on or off, and why."""
        parts = []
        for name, on in (
            ("one-call step", self.native is not None),
            ("decode attention", self.decode_attention is not None),
            ("prompt attention", self.prompt_attention is not None),
            ("fused norms", self.fused is not None),
        ):
            parts.append(f"{name}: {'C++' if on else 'torch'} ({self.why.get(name, '')})")
        if LORA_STEPS in self.why:
            parts.append(f"{LORA_STEPS}: torch ({self.why[LORA_STEPS]})")
        if self.linears:
            counts = ", ".join(f"{way} x {n}" for way, n in sorted(self.linears.items()))
            parts.append(f"linears: {counts}")
        if self.amx:
            parts.append("K-quant prompt chunks: AMX tiles (from 32 rows)")
        return "; ".join(parts)


def decide_paths(
    model: Transformer, storage: KVStorage | GroupedKVStorage, kernels: Any | None
) -> KernelPaths:
    """The paths for `model` over `storage` with the loaded C++ `kernels` (None: not built)."""
    linears = linear_paths(model)
    if kernels is None:
        why = dict.fromkeys(_NAMES, "no C++ kernels for this CPU")
        return KernelPaths(why=why, linears=linears)
    paths = KernelPaths(linears=linears)
    paths.amx = any(k in way for way in linears for k in ("Q4_K", "Q5_K", "Q6_K")) and bool(
        getattr(kernels, "ggml_amx", None) and kernels.ggml_amx()
    )
    why = paths.why
    reads = _reads_cells(model, storage, kernels)
    paths.native, why["one-call step"] = NativeDecoder.build(model, storage, kernels)
    if model.args.attn_sinks and not _takes_sinks(kernels):
        reads = "attention sinks (gpt-oss): a build without them"
    if reads is None:
        paths.decode_attention = kernels.decode_attention
        why["decode attention"] = f"{_cells(storage)} cells"
    else:
        why["decode attention"] = reads
    paths.prompt_attention, why["prompt attention"] = _prompt_kernel(model, storage, kernels)
    if model.dtype == torch.bfloat16 or paths.native is not None:
        paths.fused = kernels
        why["fused norms"] = "bfloat16" if model.dtype == torch.bfloat16 else "as the C++ step"
    else:
        why["fused norms"] = "torch's own, the float32 reference"
    return paths


def linear_paths(model: Transformer) -> dict[str, int]:
    """How each linear of `model` runs at its dtype, counted: "C++ ggml_linear <block types>"
    (a GGUF's own blocks), "C++ quant_linear <kind>" (cellserve's int4 / int8 / q8, their
    step_kind), "torch <kind>" (a quantized kind the kernels do not run at this dtype: the
    fbgemm head, or no kernels), "torch" (a dense Linear). MoE experts count one per expert."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, BlockLinear):
            kinds = "+".join(sorted({GGML_TYPE_NAMES.get(t, str(t)) for t in module.types}))
            way = f"C++ ggml_linear {kinds}"
        elif isinstance(module, QuantLinear):
            kind = module.step_kind(model.dtype) if module.kernels is not None else None
            way = f"C++ quant_linear {kind}" if kind else f"torch {module.kind}"
        elif isinstance(module, Linear):
            way = "torch"
        else:
            continue
        counts[way] = counts.get(way, 0) + 1
    return counts


_NAMES = ("one-call step", "decode attention", "prompt attention", "fused norms")
# set by a worker with LoRA adapters (model/layers/lora.py): steps with LoRA rows take the
# Python layers (step.cpp adds no low-rank delta); base-only steps keep the paths above
LORA_STEPS = "steps with LoRA rows"


def _prompt_kernel(
    model: Transformer, storage: KVStorage | GroupedKVStorage, kernels: Any
) -> tuple[Any | None, str]:
    args = model.args
    reads = _reads_cells(model, storage, kernels)
    if reads is not None:
        return None, reads
    if args.attn_sinks and not _takes_sinks(kernels):
        return None, "attention sinks (gpt-oss): a build without them"
    if model.dtype == torch.bfloat16 and not kernels.has_bf16_kernels():
        return None, "this CPU's build has no bfloat16 prompt kernel"
    if model.dtype == torch.float32 and not kernels.has_f32_kernels():
        return None, "this CPU's build has no float32 prompt kernel"
    if model.dtype not in (torch.bfloat16, torch.float32):
        return None, f"no prompt kernel for {model.dtype}"
    if args.n_kv_heads <= 0:
        return None, "no attention layers"
    if args.head_dim % 32 or args.head_dim > PROMPT_KERNEL_MAX_HEAD_DIM:
        return None, f"head_dim {args.head_dim} (the kernel takes multiples of 32 up to 256)"
    if args.n_heads // args.n_kv_heads > PROMPT_KERNEL_MAX_GQA:
        return None, f"{args.n_heads // args.n_kv_heads} query heads per K/V head (max 16)"
    return kernels.prompt_attention, f"{model.dtype}, head_dim {args.head_dim}"


def _takes_sinks(kernels: Any) -> bool:
    return bool(getattr(kernels, "has_attention_sinks", lambda: False)())


def _cells(storage: KVStorage | GroupedKVStorage) -> str:
    """K/V cache types, e.g. "q8_0/f16"; one name where both are the same."""
    k, v = storage.type_k, storage.type_v
    if k is None or v is None:
        return "no"
    return k.name if k == v else f"{k.name}/{v.name}"


def _reads_cells(
    model: Transformer, storage: KVStorage | GroupedKVStorage, kernels: Any
) -> str | None:
    """None where the attention kernels read `storage`'s cells; else why not."""
    if storage.native:
        return None
    if not getattr(kernels, "reads_cache_types", lambda: False)():
        return f"{_cells(storage)} cells, model in {model.dtype} (a build without cache types)"
    return None
