"""Read a LoRA adapter for a loaded base model: a PEFT folder (adapter_config.json +
adapter_model.safetensors) or a GGUF LoRA as llama.cpp's convert_lora_to_gguf.py writes it.

Either way the result is, per targeted linear of the base (our weight names, HF layout), the
low-rank pair A [r, in_features], B [out_features, r] and the adapter's scaling, so that the
linear computes y = W x + scaling * B (A x) (PEFT's LoraLayer; llama.cpp's llm_build_lora_mm).
- PEFT: scaling = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora; tensors
  `...layers.{i}.self_attn.q_proj.lora_A.weight` and `.lora_B.weight`.
- GGUF: general.type "adapter", adapter.type "lora", adapter.lora.alpha; tensors
  `<base tensor name>.lora_a` (numpy [r, in]) and `.lora_b` ([out, r]); scaling = alpha / r, or
  1 when alpha is 0 (llama.cpp's llama_adapter_lora_weight::get_scale). llama.cpp's converter
  permutes the Q/K rows of B as it does the base weights; they are un-permuted here as the base
  loader un-permutes wq / wk.
Only the attention (q, k, v, o) and dense MLP (gate, up, down) projections take an adapter; an
adapter that touches anything else, or whose shapes are not the base's, is refused with a
ModelLoadError that names the tensor.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from model.arch import ModelArgs, family_of_gguf
from model.arch.weights import weight_shapes
from model.errors import ModelLoadError
from model.load import gguf as gguf_load

# our weight kinds that take a LoRA pair, and their names in HF and GGUF files
LORA_KINDS = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")
_HF_PROJ = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w1",
    "up_proj": "w3",
    "down_proj": "w2",
}
_GGUF_PROJ = {gguf_load._LAYER_TENSORS[k]: k for k in LORA_KINDS}  # "attn_q.weight" -> "wq"
_PEFT_TENSOR = re.compile(
    r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)
_GGUF_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+\.weight)\.lora_([ab])$")


@dataclass(slots=True)
class LoraWeight:
    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [out_features, r]
    scaling: float


@dataclass(slots=True)
class LoraAdapter:
    """One adapter over the base: `weights` by our names ("layers.3.wq")."""

    name: str
    path: str
    rank: int
    alpha: float
    weights: dict[str, LoraWeight] = field(default_factory=dict)

    @property
    def targets(self) -> list[str]:
        """The weight kinds it adapts, sorted."""
        return sorted({k.rsplit(".", 1)[-1] for k in self.weights})


def adapter_name(path: str | Path) -> str:
    """The default served name: the folder's or file's name without .gguf."""
    p = Path(path)
    return p.stem if p.suffix == ".gguf" else p.name


def load_lora(
    path: str | Path, args: ModelArgs, dtype: torch.dtype, name: str | None = None
) -> LoraAdapter:
    """The adapter at `path` for a base described by `args`, in `dtype`; ModelLoadError when it
    cannot serve on it."""
    p = Path(path)
    if p.is_dir():
        adapter = _read_peft(p, dtype)
    elif p.is_file():
        adapter = _read_gguf(p, args, dtype)
    else:
        raise ModelLoadError(f"LoRA adapter {p}: no such file or folder")
    adapter.name = name or adapter_name(p)
    _check(adapter, args)
    return adapter


def _read_peft(folder: Path, dtype: torch.dtype) -> LoraAdapter:
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ModelLoadError(
            f"LoRA adapter {folder}: a PEFT folder needs adapter_config.json and "
            "adapter_model.safetensors"
        )
    config = json.loads(config_file.read_text())
    peft_type = str(config.get("peft_type", "LORA")).upper()
    for bad, why in (
        (peft_type != "LORA", f"peft_type {peft_type} (only LORA is served)"),
        (config.get("use_dora"), "DoRA (use_dora) is not served"),
        (config.get("fan_in_fan_out"), "fan_in_fan_out (Conv1D layers) is not served"),
        (config.get("bias", "none") != "none", f"bias {config.get('bias')!r} (only 'none')"),
        (config.get("modules_to_save"), "modules_to_save (full copies of modules)"),
        (config.get("rank_pattern") or config.get("alpha_pattern"), "rank/alpha patterns"),
    ):
        if bad:
            raise ModelLoadError(f"LoRA adapter {folder}: {why}")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in load_file(str(weights_file)).items():
        m = _PEFT_TENSOR.search(key)
        kind = _HF_PROJ.get(m.group(2)) if m else None
        if m is None or kind is None:
            raise ModelLoadError(
                f"LoRA adapter {folder}: tensor {key} adapts a module this server does not "
                f"(it serves adapters on {', '.join(_HF_PROJ)})"
            )
        pairs.setdefault(f"layers.{m.group(1)}.{kind}", {})[m.group(3)] = t
    weights = {}
    for ours, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ModelLoadError(f"LoRA adapter {folder}: {ours} has lora_A or lora_B only")
        weights[ours] = LoraWeight(pair["A"].to(dtype), pair["B"].to(dtype), scaling)
    return LoraAdapter("", str(folder), rank, alpha, weights)


def _read_gguf(path: Path, args: ModelArgs, dtype: torch.dtype) -> LoraAdapter:
    reader = gguf_load.open_gguf(path)

    def get(key: str) -> object:
        return gguf_load.field_value(reader, key)

    if get("general.type") != "adapter" or get("adapter.type") != "lora":
        raise ModelLoadError(
            f"LoRA adapter {path}: not a GGUF LoRA (general.type {get('general.type')!r}, "
            f"adapter.type {get('adapter.type')!r}; want 'adapter' and 'lora')"
        )
    arch = get("general.architecture")
    if arch != args.arch:
        raise ModelLoadError(
            f"LoRA adapter {path}: made for a {arch!r} model, the base model is {args.arch!r}"
        )
    alpha = float(get("adapter.lora.alpha") or 0.0)  # type: ignore[arg-type]
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        m = _GGUF_TENSOR.match(t.name)
        kind = _GGUF_PROJ.get(m.group(2)) if m else None
        if m is None or kind is None:
            if t.name.endswith("_norm.weight"):  # llama.cpp skips these too
                continue
            raise ModelLoadError(
                f"LoRA adapter {path}: tensor {t.name} adapts a tensor this server does not "
                f"(it serves adapters on {', '.join(_GGUF_PROJ)})"
            )
        w = gguf_load.dequantize(t).reshape(tuple(reversed(t.shape)))
        pairs.setdefault(f"layers.{m.group(1)}.{kind}", {})[m.group(3)] = w
    weights, ranks = {}, set()
    family = family_of_gguf(str(args.arch))
    permuted = family is not None and family.gguf_permuted_qk
    for ours, pair in pairs.items():
        if set(pair) != {"a", "b"}:
            raise ModelLoadError(f"LoRA adapter {path}: {ours} has lora_a or lora_b only")
        a, b = pair["a"], pair["b"]
        kind = ours.rsplit(".", 1)[-1]
        if permuted and kind in ("wq", "wk"):
            b = gguf_load._unpermute(b, args.n_heads if kind == "wq" else args.n_kv_heads)
        rank = a.shape[0]
        ranks.add(rank)
        scaling = alpha / rank if alpha else 1.0
        weights[ours] = LoraWeight(_tensor(a, dtype), _tensor(b, dtype), scaling)
    rank = max(ranks) if ranks else 0
    return LoraAdapter("", str(path), rank, alpha, weights)


def _tensor(w: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)


def _check(adapter: LoraAdapter, args: ModelArgs) -> None:
    """Every pair fits a dense projection of the base: ModelLoadError otherwise."""
    if not adapter.weights:
        raise ModelLoadError(f"LoRA adapter {adapter.path}: no LoRA tensors")
    shapes = weight_shapes(args)
    for ours, w in adapter.weights.items():
        layer, kind = int(ours.split(".")[1]), ours.rsplit(".", 1)[-1]
        where = f"LoRA adapter {adapter.path}: {ours}"
        if layer >= args.n_layers:
            raise ModelLoadError(f"{where}: the base model has {args.n_layers} layers")
        desc = args.layer_desc(layer)
        if kind in ("wq", "wk", "wv", "wo") and not args.has_attention(layer):
            raise ModelLoadError(f"{where}: layer {layer} has no attention projections")
        if kind in ("w1", "w3", "w2") and (desc.moe or not desc.ffn):
            raise ModelLoadError(f"{where}: layer {layer} has no dense MLP (experts take none)")
        n, k = shapes[kind]
        r = w.a.shape[0]
        if w.a.dim() != 2 or w.b.dim() != 2 or w.a.shape[1] != k or tuple(w.b.shape) != (n, r):
            raise ModelLoadError(
                f"{where}: A {tuple(w.a.shape)} and B {tuple(w.b.shape)} do not fit the base "
                f"weight {(n, k)} (want A [r, {k}], B [{n}, r]): an adapter for another model?"
            )
