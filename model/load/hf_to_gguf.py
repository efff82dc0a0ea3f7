"""Write a Hugging Face Mamba, Falcon-Mamba, Mamba2 or GraniteMoeHybrid (Granite 4.0-H) folder as
a GGUF file in llama.cpp's layout ("mamba", "mamba2", "granitehybrid"), so that llama.cpp and
model/load/gguf.py read it; a BERT folder goes to model/load/bert_to_gguf.py (llama.cpp's
"bert").

    python -m model.load.hf_to_gguf FOLDER OUT.gguf [--outtype f32|f16]

Follows llama.cpp's convert_hf_to_gguf (MambaModel, Mamba2Model, GraniteHybridModel) with two
deliberate
differences: a dense Granite's feed_forward_length is shared_intermediate_size (the FFN it runs;
llama.cpp writes intermediate_size, the experts' width, which is what a Granite with experts
writes here too: its shared MLP goes to ffn_*_shexp), and RoPE is on when the config says
position_embedding_type "rope" (llama.cpp decides by the Bamba architecture name). Only byte-level
BPE tokenizers (tokenizer.json) are written, as llama.cpp's "gpt2" model.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors import safe_open

from model.errors import ModelLoadError
from model.load.bert_to_gguf import convert_bert
from model.load.bpe_to_gguf import write_bpe_tokenizer
from model.load.hf_config import read_config
from model.load.mamba_to_gguf import NOPE_CONTEXT, check_mamba1, mamba1_layer, write_mamba1_params

_MAMBA_TENSORS = {  # HF mixer tensor -> GGUF, per layer
    "in_proj.weight": "ssm_in.weight",
    "conv1d.weight": "ssm_conv1d.weight",
    "conv1d.bias": "ssm_conv1d.bias",
    "dt_bias": "ssm_dt.bias",
    "A_log": "ssm_a",
    "D": "ssm_d",
    "norm.weight": "ssm_norm.weight",
    "out_proj.weight": "ssm_out.weight",
}
_ATTN_TENSORS = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
}


def convert(folder: str | Path, out: str | Path, outtype: str = "f32") -> Path:
    """Raises ModelLoadError (naming the folder) for what llama.cpp's layout cannot hold."""
    folder, out = Path(folder), Path(out)
    if outtype not in ("f32", "f16"):
        raise ValueError(f"outtype {outtype!r}: f32 or f16")
    config = read_config(folder)
    model_type = config.get("model_type")
    if model_type == "bert":
        return convert_bert(folder, out, outtype)
    tensors = _read_safetensors(folder)
    try:
        if model_type in ("mamba", "falcon_mamba"):
            arch, layers = "mamba", ["mamba1"] * int(config["num_hidden_layers"])
        elif model_type == "mamba2":
            arch, layers = "mamba2", ["mamba"] * int(config["num_hidden_layers"])
        elif model_type == "granitemoehybrid":
            arch, layers = "granitehybrid", _granite_layers(config, folder)
        else:
            raise ModelLoadError(
                f"{folder}: model_type {model_type!r} cannot be converted (mamba, "
                "falcon_mamba, mamba2, granitemoehybrid and bert can)."
            )
        if arch == "mamba":
            check_mamba1(config, folder)
        else:
            _check_mixer(config, arch == "granitehybrid", folder)
        used: set[str] = set()
        out_tensors = list(_gguf_tensors(arch, config, layers, tensors, used, folder))
        unused = sorted(set(tensors) - used)
        if unused:
            raise ModelLoadError(
                f"{folder}: tensors llama.cpp's {arch} layout has no place for: "
                f"{', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}."
            )
        writer = gguf.GGUFWriter(str(out), arch)
        n_vocab = int(tensors[_embed_name(arch)].shape[0])
        _write_params(writer, arch, config, layers, n_vocab, folder)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{folder}/config.json: bad or missing field ({e}).") from e
    write_bpe_tokenizer(writer, folder, config, n_vocab)
    for name, w in out_tensors:
        kind = _tensor_type(name, w, outtype)
        writer.add_tensor(name, w.astype(np.float16 if kind == "F16" else np.float32))
    f16 = outtype == "f16"
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _read_safetensors(folder: Path) -> dict[str, np.ndarray]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights.")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = f.get_tensor(name).float().numpy()
    return tensors


def _granite_layers(config: dict[str, Any], folder: Path) -> list[str]:
    if config.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{folder}: hidden_act {config['hidden_act']!r} (silu only).")
    # NOTE: transformers 5 saves "linear_attention"/"full_attention", published configs
    # "mamba"/"attention" (layers_block_type in older ones)
    kinds = {"mamba": "mamba", "linear_attention": "mamba"}
    kinds |= {"attention": "attention", "full_attention": "attention"}
    types = config.get("layer_types") or config.get("layers_block_type")
    if not types or len(types) != config["num_hidden_layers"]:
        raise ModelLoadError(f"{folder}: layer_types must name each of the layers.")
    unknown = sorted({t for t in types if t not in kinds})
    if unknown:
        raise ModelLoadError(f"{folder}: unknown layer types {unknown}.")
    return [kinds[t] for t in types]


def _check_mixer(config: dict[str, Any], granite: bool, folder: Path) -> None:
    """Refuse the Mamba2 variants llama.cpp's layout cannot hold, and the biases we do not run."""
    p = "mamba_" if granite else ""
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ModelLoadError(f"{folder}: attention or MLP biases are not supported.")
    dim = int(config["hidden_size"])
    d_inner = int(config[f"{p}n_heads" if granite else "num_heads"])
    d_inner *= int(config[f"{p}d_head" if granite else "head_dim"])
    if d_inner != 2 * dim:
        raise ModelLoadError(
            f"{folder}: the Mamba2 inner size {d_inner} is not 2 x hidden_size {dim} "
            "(llama.cpp only loads an expansion factor of 2)."
        )
    if config.get(f"{p}proj_bias" if granite else "use_bias"):
        raise ModelLoadError(f"{folder}: Mamba2 in/out projection biases are not supported.")
    limit = [_json_float(v) for v in config.get("time_step_limit", [0.0, math.inf])]
    if limit != [0.0, math.inf]:
        raise ModelLoadError(
            f"{folder}: time_step_limit {limit} cannot be written (llama.cpp never clamps dt)."
        )


def _write_params(
    w: gguf.GGUFWriter,
    arch: str,
    config: dict[str, Any],
    layers: list[str],
    n_vocab: int,
    folder: Path,
) -> None:
    if arch == "mamba":
        write_mamba1_params(w, config, len(layers))
        return
    granite = arch == "granitehybrid"
    p = "mamba_" if granite else ""
    dim = int(config["hidden_size"])
    n_heads_ssm = int(config[f"{p}n_heads" if granite else "num_heads"])
    d_head_ssm = int(config[f"{p}d_head" if granite else "head_dim"])
    d_inner = n_heads_ssm * d_head_ssm
    w.add_block_count(len(layers))
    w.add_embedding_length(dim)
    w.add_ssm_conv_kernel(int(config[f"{p}d_conv" if granite else "conv_kernel"]))
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(int(config[f"{p}d_state" if granite else "state_size"]))
    w.add_ssm_time_step_rank(n_heads_ssm)  # NOTE: the head count, as llama.cpp reads it
    w.add_ssm_group_count(int(config[f"{p}n_groups" if granite else "n_groups"]))
    if not granite:
        w.add_context_length(NOPE_CONTEXT)
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        w.add_layer_norm_rms_eps(float(config.get("layer_norm_epsilon", 1e-5)))
        return
    n_heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or dim // n_heads)
    rope = config.get("position_embedding_type") == "rope"
    rope_params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    w.add_vocab_size(n_vocab)
    w.add_context_length(int(config.get("max_position_embeddings", 2048)) if rope else NOPE_CONTEXT)
    n_experts = int(config.get("num_local_experts") or 0)
    if n_experts:  # llama.cpp's granitehybrid: ffn_*_exps n_ff wide, ffn_*_shexp n_ff_shexp
        w.add_feed_forward_length(int(config["intermediate_size"]))
        w.add_expert_used_count(int(config["num_experts_per_tok"]))
    else:
        w.add_feed_forward_length(int(config["shared_intermediate_size"]))
    w.add_expert_shared_feed_forward_length(int(config["shared_intermediate_size"]))
    w.add_expert_count(n_experts)
    w.add_head_count(n_heads)
    kv = int(config.get("num_key_value_heads") or n_heads)
    w.add_head_count_kv([kv if t == "attention" else 0 for t in layers])
    if head_dim != dim // n_heads:  # llama.cpp's default is dim / n_heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(theta))
    w.add_rope_scaling_finetuned(rope)  # NOTE: false = no position encoding (llama.cpp)
    w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    # NOTE: llama.cpp stores only values that are set, and reads 0 as "not scaled"
    if scale := config.get("attention_multiplier"):
        w.add_attention_scale(float(scale))
    if scale := config.get("embedding_multiplier"):
        w.add_embedding_scale(float(scale))
    if scale := config.get("residual_multiplier"):
        w.add_residual_scale(float(scale))
    if scale := config.get("logits_scaling"):
        w.add_logit_scale(float(scale))  # llama.cpp divides the logits by it


def _json_float(value: Any) -> float:
    """transformers writes infinities as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def _embed_name(arch: str) -> str:
    backbone = arch in ("mamba", "mamba2")
    return "backbone.embeddings.weight" if backbone else "model.embed_tokens.weight"


def _gguf_tensors(
    arch: str,
    config: dict[str, Any],
    layers: list[str],
    tensors: dict[str, np.ndarray],
    used: set[str],
    folder: Path,
) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, numpy array in llama.cpp's layout); `used` collects the HF names read."""

    def take(name: str) -> np.ndarray:
        if name not in tensors:
            raise ModelLoadError(f"{folder}: tensor {name} is missing from the safetensors.")
        used.add(name)
        return tensors[name]

    granite = arch == "granitehybrid"
    base = "model" if granite else "backbone"
    yield "token_embd.weight", take(_embed_name(arch))
    yield "output_norm.weight", take(f"{base}.norm.weight" if granite else "backbone.norm_f.weight")
    if "lm_head.weight" in tensors:  # absent when tied (save_pretrained drops tied weights)
        head = take("lm_head.weight")
        # llama.cpp's MambaModel omits a head equal to the embedding (a tied one saved anyway)
        if arch != "mamba" or not np.array_equal(head, tensors[_embed_name(arch)]):
            yield "output.weight", head
    if arch == "mamba":
        for i in range(len(layers)):
            yield from mamba1_layer(i, take, tensors)
        return
    n_groups = int(config["mamba_n_groups" if granite else "n_groups"])
    n_heads = int(config.get("num_attention_heads", 0))
    n_kv = int(config.get("num_key_value_heads") or n_heads)
    for i, kind in enumerate(layers):
        hf, blk = f"{base}.layers.{i}.", f"blk.{i}."
        yield (
            blk + "attn_norm.weight",
            take(hf + ("input_layernorm.weight" if granite else "norm.weight")),
        )
        if kind == "mamba":
            mixer = hf + ("mamba." if granite else "mixer.")
            for name, gguf_name in _MAMBA_TENSORS.items():
                if name == "conv1d.bias" and mixer + name not in tensors:  # use_conv_bias false
                    if not granite:  # NOTE: llama.cpp's mamba2 requires it; zeros change nothing
                        conv_dim = tensors[mixer + "conv1d.weight"].shape[0]
                        yield blk + gguf_name, np.zeros(conv_dim, np.float32)
                    continue
                yield blk + gguf_name, _to_gguf_layout(name, take(mixer + name), n_groups)
        else:
            for name, gguf_name in _ATTN_TENSORS.items():
                w = take(hf + name)
                if name.startswith("self_attn.q"):
                    w = _permute(w, n_heads)
                elif name.startswith("self_attn.k"):
                    w = _permute(w, n_kv)
                yield blk + gguf_name, w
        if granite:
            yield blk + "ffn_norm.weight", take(hf + "post_attention_layernorm.weight")
            yield from _granite_ffn(config, hf, blk, take, folder)


def _granite_ffn(
    config: dict[str, Any], hf: str, blk: str, take: Any, folder: Path
) -> Iterator[tuple[str, np.ndarray]]:
    """The shared MLP (the FFN, or with experts the shared expert beside them) and the experts:
    input_linear holds the gates then the ups (split as llama.cpp's converter splits them)."""
    f = int(config["shared_intermediate_size"])
    gate_up = take(hf + "shared_mlp.input_linear.weight")
    if gate_up.shape[0] != 2 * f:
        raise ModelLoadError(f"{folder}: {hf}shared_mlp.input_linear.weight is not [2 x {f}, dim].")
    suffix = "_shexp" if config.get("num_local_experts") else ""
    yield blk + f"ffn_gate{suffix}.weight", gate_up[:f]
    yield blk + f"ffn_up{suffix}.weight", gate_up[f:]
    yield blk + f"ffn_down{suffix}.weight", take(hf + "shared_mlp.output_linear.weight")
    if not suffix:
        return
    f_exp = int(config["intermediate_size"])
    moe = hf + "block_sparse_moe."
    experts = take(moe + "input_linear.weight")  # [E, 2 f, d]
    if experts.ndim != 3 or experts.shape[1] != 2 * f_exp:
        raise ModelLoadError(f"{folder}: {moe}input_linear.weight is not [E, 2 x {f_exp}, dim].")
    yield blk + "ffn_gate_inp.weight", take(moe + "router.layer.weight")
    yield blk + "ffn_gate_exps.weight", np.ascontiguousarray(experts[:, :f_exp])
    yield blk + "ffn_up_exps.weight", np.ascontiguousarray(experts[:, f_exp:])
    yield blk + "ffn_down_exps.weight", take(moe + "output_linear.weight")


def _to_gguf_layout(name: str, w: np.ndarray, n_groups: int) -> np.ndarray:
    if name == "conv1d.weight":
        return w.reshape(w.shape[0], w.shape[-1])  # [conv_dim, 1, K] -> [conv_dim, K]
    if name == "A_log":
        return -np.exp(w).reshape(-1, 1)
    if name == "D":
        return w.reshape(-1, 1)
    if name == "norm.weight":
        return w.reshape(n_groups, -1)
    return w


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF rotate-half rows -> interleaved pairs, per head."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _tensor_type(name: str, w: np.ndarray, outtype: str) -> str:
    """llama.cpp keeps 1-D tensors, tensors without a .weight suffix, the conv, the norms and
    the experts' router in F32."""
    small = "ssm_conv1d" in name or "ffn_gate_inp" in name or name.endswith("norm.weight")
    if outtype == "f32" or w.ndim < 2 or not name.endswith(".weight") or small:
        return "F32"
    return "F16"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m model.load.hf_to_gguf", description=__doc__)
    parser.add_argument("folder", type=Path, help="Hugging Face model folder")
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    parser.add_argument("--outtype", choices=("f32", "f16"), default="f32")
    args = parser.parse_args(argv)
    try:
        path = convert(args.folder, args.out, args.outtype)
    except ModelLoadError as e:
        raise SystemExit(f"error: {e}") from e
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
