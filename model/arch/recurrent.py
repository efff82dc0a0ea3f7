"""The recurrent and hybrid families: Mamba2, Granite 4.0-H (Mamba2 mixers with some attention
layers) and LFM2 (gated short convolutions with some attention layers). Their ModelArgs differ
from the start (per-layer mixers, state shapes), so model/load/gguf_ssm.py and hf_ssm.py read
them whole; these entries say what the shared loaders need to know of them."""

from __future__ import annotations

from model.arch import qwen3
from model.arch.family import Family

MAMBA2 = Family(arch="mamba2", model_types=("mamba2",), recurrent=True, file_blocks=False)
GRANITE_HYBRID = Family(
    arch="granitehybrid",
    model_types=("granitemoehybrid", "bamba"),
    recurrent=True,
    file_blocks=False,
    gguf_permuted_qk=True,
)
# LFM2: q/k norms per head (Qwen3's block); most layers a gated short conv (ModelArgs.short_conv),
# two linears around a conv that stays dense
LFM2 = Family(arch="lfm2", model_types=("lfm2",), block=qwen3.BLOCK, recurrent=True)
