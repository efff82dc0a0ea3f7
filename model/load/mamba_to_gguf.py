"""The Mamba (1) / Falcon-Mamba part of model/load/hf_to_gguf.py: what llama.cpp's
convert_hf_to_gguf MambaModel writes for a `mamba` / `falcon_mamba` folder (arch "mamba"): its
keys, and per layer the norm and the mixer's tensors (A = -exp(A_log), the conv squeezed, a
zero conv bias where the folder has none)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from model.errors import ModelLoadError

NOPE_CONTEXT = 2**20  # llama.cpp writes this context length when nothing bounds positions
TENSORS = {  # Mamba (1) / Falcon-Mamba: HF mixer tensor -> GGUF, per layer
    "in_proj.weight": "ssm_in.weight",
    "conv1d.weight": "ssm_conv1d.weight",
    "conv1d.bias": "ssm_conv1d.bias",
    "x_proj.weight": "ssm_x.weight",
    "dt_proj.weight": "ssm_dt.weight",
    "dt_proj.bias": "ssm_dt.bias",
    "A_log": "ssm_a",
    "D": "ssm_d",
    "out_proj.weight": "ssm_out.weight",
}


def check_mamba1(config: dict[str, Any], folder: Path) -> None:
    """Refuse the Mamba (1) variants llama.cpp's "mamba" layout cannot hold."""
    if config.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{folder}: hidden_act {config['hidden_act']!r} (silu only).")
    dim, d_inner = int(config["hidden_size"]), int(config["intermediate_size"])
    if d_inner != 2 * dim:
        raise ModelLoadError(
            f"{folder}: the Mamba inner size {d_inner} is not 2 x hidden_size {dim} "
            "(llama.cpp only converts an expansion factor of 2)."
        )
    if config.get("use_bias"):
        raise ModelLoadError(f"{folder}: Mamba in/out projection biases are not supported.")


def write_mamba1_params(w: gguf.GGUFWriter, config: dict[str, Any], n_layers: int) -> None:
    """llama.cpp's MambaModel.set_gguf_parameters; Falcon-Mamba norms dt, B and C
    (ssm.dt_b_c_rms) with the model's rms epsilon (the format has no key for mixer_rms_eps)."""
    dim = int(config["hidden_size"])
    w.add_context_length(NOPE_CONTEXT)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(n_layers)
    w.add_ssm_conv_kernel(int(config.get("conv_kernel", 4)))
    w.add_ssm_inner_size(int(config["intermediate_size"]))
    w.add_ssm_state_size(int(config.get("state_size", 16)))
    w.add_ssm_time_step_rank(int(config["time_step_rank"]))
    w.add_layer_norm_rms_eps(float(config.get("layer_norm_epsilon", 1e-5)))
    w.add_ssm_dt_b_c_rms(config.get("model_type") == "falcon_mamba")


def mamba1_layer(
    i: int, take: Callable[[str], np.ndarray], tensors: dict[str, np.ndarray]
) -> Iterator[tuple[str, np.ndarray]]:
    """Layer i's (GGUF name, numpy array in llama.cpp's layout); `take` reads (and marks) an
    HF tensor."""
    hf, blk = f"backbone.layers.{i}.", f"blk.{i}."
    yield blk + "attn_norm.weight", take(hf + "norm.weight")
    mixer = hf + "mixer."
    for name, gguf_name in TENSORS.items():
        if name == "conv1d.bias" and mixer + name not in tensors:  # use_conv_bias false
            # NOTE: llama.cpp's mamba requires it; zeros change nothing
            conv_dim = tensors[mixer + "conv1d.weight"].shape[0]
            yield blk + gguf_name, np.zeros(conv_dim, np.float32)
            continue
        w = take(mixer + name)
        if name == "conv1d.weight":
            w = w.reshape(w.shape[0], w.shape[-1])  # [d_inner, 1, K] -> [d_inner, K]
        elif name == "A_log":
            w = -np.exp(w)  # [d_inner, N]
        yield blk + gguf_name, w
