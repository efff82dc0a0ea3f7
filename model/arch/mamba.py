"""Mamba (1) and Falcon-Mamba: every layer a Mamba mixer (model/layers/mamba.py) over the
sequence's state slot, no MLP, no position encoding. Its mixer's sizes and tensors are shared
with Jamba (model/arch/jamba.py's hybrid of it with attention and experts).

GGUF (llama.cpp convert_hf_to_gguf MambaModel, llama-model.cpp LLM_ARCH_MAMBA): ssm.inner_size
= d_inner, ssm.state_size, ssm.conv_kernel, ssm.time_step_rank = dt_rank, ssm.dt_b_c_rms
(Falcon-Mamba: dt, B and C RMS-normed without weights, with the model's own rms epsilon).
Numpy shapes of the tensors (ggml's reversed): ssm_conv1d.weight [d_inner, K] (HF's
[d_inner, 1, K] squeezed), ssm_x.weight [dt_rank + 2 N, d_inner], ssm_dt.weight [d_inner,
dt_rank], ssm_a = -exp(A_log) [d_inner, N], ssm_d [d_inner]. HF: MambaConfig /
FalconMambaConfig under backbone.*, A_log (Falcon-Mamba's norms use its mixer_rms_eps).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Literal

from model.arch import mamba2
from model.arch.args import MambaArgs, ModelArgs
from model.arch.family import Family, GGUFMeta, check_hf_silu
from model.errors import ModelLoadError

GGUF_NAMES = {
    "ssm_in": "ssm_in.weight",
    "ssm_conv": "ssm_conv1d.weight",
    "ssm_conv_b": "ssm_conv1d.bias",
    "ssm_x": "ssm_x.weight",
    "ssm_dt": "ssm_dt.weight",
    "ssm_dt_b": "ssm_dt.bias",
    "ssm_a": "ssm_a",
    "ssm_d": "ssm_d",
    "ssm_out": "ssm_out.weight",
    "ssm_dt_norm": "ssm_dt_norm.weight",  # Jamba's
    "ssm_b_norm": "ssm_b_norm.weight",
    "ssm_c_norm": "ssm_c_norm.weight",
}
# a mixer's tensors in an HF layer, under its prefix ("mixer." here, Jamba's "mamba.")
HF_MIXER_NAMES = {
    "ssm_in": "in_proj.weight",
    "ssm_in_b": "in_proj.bias",
    "ssm_conv": "conv1d.weight",
    "ssm_conv_b": "conv1d.bias",
    "ssm_x": "x_proj.weight",
    "ssm_dt": "dt_proj.weight",
    "ssm_dt_b": "dt_proj.bias",
    "ssm_a": "A_log",
    "ssm_d": "D",
    "ssm_out": "out_proj.weight",
    "ssm_out_b": "out_proj.bias",
    "ssm_dt_norm": "dt_layernorm.weight",
    "ssm_b_norm": "b_layernorm.weight",
    "ssm_c_norm": "c_layernorm.weight",
}


def gguf_mamba(meta: GGUFMeta, eps: float, layers: list[int]) -> MambaArgs:
    """The mixer's sizes; from the tensors of its `layers` whether the conv has a bias and
    whether dt, B and C are normed with weights (Jamba) or, where ssm.dt_b_c_rms says,
    without (Falcon-Mamba)."""
    d_inner, dt_rank = int(meta.get("ssm.inner_size")), int(meta.get("ssm.time_step_rank"))
    if d_inner <= 0 or dt_rank <= 0:
        raise ModelLoadError(
            f"{meta.path}: inconsistent Mamba sizes: ssm.inner_size {d_inner}, "
            f"ssm.time_step_rank {dt_rank}."
        )
    for name in ("ssm_in.bias", "ssm_out.bias"):
        if any(meta.has(f"blk.{i}.{name}") for i in layers):
            raise ModelLoadError(
                f"{meta.path}: Mamba projection biases ({name}) are not in llama.cpp's layout "
                "and not supported."
            )
    conv_bias = _all_or_none(meta, layers, "ssm_conv1d.bias")
    weighted = _all_or_none(meta, layers, "ssm_dt_norm.weight")
    norm: Literal["none", "plain", "weighted"] = "weighted" if weighted else "none"
    if not weighted and bool(meta.get("ssm.dt_b_c_rms", False)):
        norm = "plain"
    return MambaArgs(
        d_inner=d_inner,
        d_state=int(meta.get("ssm.state_size")),
        d_conv=int(meta.get("ssm.conv_kernel")),
        dt_rank=dt_rank,
        conv_bias=conv_bias,
        dt_b_c_norm=norm,
        norm_eps=eps,
    )


def _all_or_none(meta: GGUFMeta, layers: list[int], name: str) -> bool:
    have = [i for i in layers if meta.has(f"blk.{i}.{name}")]
    if have and len(have) != len(layers):
        raise ModelLoadError(f"{meta.path}: only some Mamba layers have {name} (inconsistent).")
    return bool(have)


def gguf_args(meta: GGUFMeta, vocab_size: int) -> ModelArgs:
    n_layers = int(meta.get("block_count"))
    eps = float(meta.get("attention.layer_norm_rms_epsilon"))
    # n_ctx_train 0: llama.cpp's converter writes 2**20, no trained limit
    return mamba2.recurrent_args(
        meta, "mamba", "mamba", vocab_size, int(meta.get("embedding_length")), n_layers, eps,
        mamba=gguf_mamba(meta, eps, list(range(n_layers))),
    )  # fmt: skip


def gguf_convert(kind: str, w: Any, args: ModelArgs) -> Any:
    return w  # llama.cpp stores every mixer tensor in the layout read here


def hf_mamba(config: dict[str, Any], dim: int, pre: str, norm: str, norm_eps: float) -> MambaArgs:
    """MambaConfig's fields, or Jamba's mamba_* ones (pre "mamba_"); `norm` of dt / B / C."""
    expand = int(float(config.get(pre + "expand", 2)) * dim)  # transformers': int(expand * dim)
    d_inner = expand if pre else int(config.get("intermediate_size") or expand)
    rank = config.get(pre + ("dt_rank" if pre else "time_step_rank"), "auto")
    dt_rank = -(dim // -16) if rank in (None, "auto") else int(rank)
    state = config[pre + ("d_state" if pre else "state_size")]
    conv = config[pre + ("d_conv" if pre else "conv_kernel")]
    conv_bias = config.get(pre + ("conv_bias" if pre else "use_conv_bias"), True)
    proj_bias = config.get(pre + ("proj_bias" if pre else "use_bias"), False)
    return MambaArgs(
        d_inner=d_inner,
        d_state=int(state),
        d_conv=int(conv),
        dt_rank=dt_rank,
        conv_bias=bool(conv_bias),
        proj_bias=bool(proj_bias),
        dt_b_c_norm=norm,  # type: ignore[arg-type]
        norm_eps=norm_eps,
    )


def hf_args(config: dict[str, Any]) -> ModelArgs:
    check_hf_silu(config)
    dim = int(config["hidden_size"])
    falcon = config.get("model_type") == "falcon_mamba"
    norm_eps = float(config.get("mixer_rms_eps", 1e-6))
    mamba = hf_mamba(config, dim, "", "plain" if falcon else "none", norm_eps)
    return mamba2.recurrent_args(
        None, "mamba", "mamba", int(config["vocab_size"]), dim, int(config["num_hidden_layers"]),
        float(config.get("layer_norm_epsilon", 1e-5)), mamba=mamba,
    )  # fmt: skip


def hf_tensors(args: ModelArgs, present: Collection[str]) -> dict[str, str]:
    return mamba2.backbone_tensors(args, present, HF_MIXER_NAMES)


FAMILY = Family(
    arch="mamba",
    model_types=("mamba", "falcon_mamba"),
    recurrent=True,
    hf_tied=True,  # MambaConfig's default
    gguf_names=GGUF_NAMES,
    gguf_args=gguf_args,
    hf_args=hf_args,
    hf_tensors=hf_tensors,
    hf_convert=mamba2.hf_convert,
    gguf_convert=gguf_convert,
)
