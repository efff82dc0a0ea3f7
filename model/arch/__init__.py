"""The architectures: what a decoder computes (model/arch/args.py) and one file per family saying
how its files map onto that (model/arch/family.py says what a family file declares).

`FAMILIES` lists every family served; `family_of_gguf(arch)` and `family_of_hf(model_type)` find
one, None for an architecture that is not served (the loaders refuse it by name).
"""

from __future__ import annotations

from model.arch import (
    exaone4,
    falcon_h1,
    gemma2,
    gemma3,
    glm4,
    gpt_oss,
    granite,
    granite_hybrid,
    jamba,
    lfm2,
    llama,
    mamba,
    mamba2,
    olmo2,
    olmoe,
    phi3,
    qwen2,
    qwen2moe,
    qwen3,
    qwen3moe,
    smollm3,
)
from model.arch.args import (
    LLAMA,
    Activation,
    BlockSpec,
    LayerDesc,
    LongRope,
    MambaArgs,
    Mixer,
    ModelArgs,
    MoEArgs,
    SSMArgs,
    periodic_windows,
)
from model.arch.family import Family, GGUFMeta

__all__ = [
    "FAMILIES",
    "LLAMA",
    "Activation",
    "BlockSpec",
    "Family",
    "GGUFMeta",
    "LayerDesc",
    "LongRope",
    "MambaArgs",
    "Mixer",
    "ModelArgs",
    "MoEArgs",
    "SSMArgs",
    "family_of_gguf",
    "family_of_hf",
    "periodic_windows",
]

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    smollm3.FAMILY,
    gemma2.FAMILY,
    gemma3.FAMILY,
    phi3.FAMILY,
    olmo2.FAMILY,
    exaone4.FAMILY,
    glm4.FAMILY,
    granite.FAMILY,
    mamba.FAMILY,
    mamba2.FAMILY,
    granite_hybrid.FAMILY,
    falcon_h1.FAMILY,
    jamba.FAMILY,
    lfm2.FAMILY,
    lfm2.MOE_FAMILY,
    qwen3moe.FAMILY,
    qwen2moe.FAMILY,
    olmoe.FAMILY,
    granite.MOE_FAMILY,
    gpt_oss.FAMILY,
)
_BY_GGUF = {f.arch: f for f in FAMILIES}
_BY_HF = {t: f for f in FAMILIES for t in f.model_types}


def family_of_gguf(arch: str) -> Family | None:
    """The family of a GGUF file's general.architecture."""
    return _BY_GGUF.get(arch)


def family_of_hf(model_type: str) -> Family | None:
    """The family of a config.json's model_type."""
    return _BY_HF.get(model_type)
