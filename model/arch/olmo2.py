"""OLMo 2: OLMoE's whole-projection q/k norms; norms on the sublayers' outputs only (no pre
norms), named in its HF files as Gemma's are."""

from __future__ import annotations

from model.arch.args import BlockSpec
from model.arch.family import GEMMA_HF_NAMES, Family

BLOCK = BlockSpec(qk_norm=True, qk_norm_full=True, post_norms=True, pre_norms=False)
FAMILY = Family(arch="olmo2", model_types=("olmo2",), block=BLOCK, hf_names=GEMMA_HF_NAMES)
