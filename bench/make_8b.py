"""`python -m bench.make_8b`: the Llama-3.1-8B-shaped benchmark model (issue 25), made the way a
user's GGUF is made: a Hugging Face folder (transformers' LlamaConfig, SmolLM2's tokenizer, random
weights of std 0.02 in bfloat16), converted by llama.cpp's own `convert_hf_to_gguf.py` and
quantized to Q4_K_M by its `llama-quantize` (both kept by bench/build_llamacpp.sh). Speed does not
depend on the weights' values, so the model serves as an 8B would, only its text is noise.

The folder (15 GB) is written one layer at a time, so the 8B never sits in memory; the bf16 GGUF
(15 GB) and the folder are deleted once the Q4_K_M (4.5 GB) is written, unless --keep. Prints the
GGUF's path; an existing one is reused. `python -m bench.run --model llama-3.1-8b-shape` serves it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

NAME = "llama-3.1-8b-shape"


@dataclass(frozen=True, slots=True)
class Shape:
    """Llama-3.1-8B's (meta-llama/Llama-3.1-8B config.json) but SmolLM2's vocabulary."""

    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_position_embeddings: int = 131072


LLAMA_31_8B = Shape()
ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def default_path(name: str = NAME) -> pathlib.Path:
    """In the user's cache, beside the packaged models (model/load/packaged.py cache_dir)."""
    from model.load.packaged import cache_dir

    return cache_dir() / name / f"{name}-Q4_K_M.gguf"


def _smollm2_vocab() -> dict:
    """SmolLM2's tokenizer as the embedded GGUF stores it (cellserve's own header reader)."""
    from model.load.gguf_file import GGUFFile
    from model.load.loader import default_model_path

    fields = GGUFFile(default_model_path()).fields
    return {
        "tokens": fields["tokenizer.ggml.tokens"],
        "merges": fields["tokenizer.ggml.merges"],
        "types": fields["tokenizer.ggml.token_type"],
        "bos": int(fields["tokenizer.ggml.bos_token_id"]),
        "eos": int(fields["tokenizer.ggml.eos_token_id"]),
        "chat_template": fields["tokenizer.chat_template"],
    }


def write_tokenizer(folder: pathlib.Path, v: dict) -> None:
    """SmolLM2's tokenizer.json (byte-level BPE, digits split one by one: the pre-tokenizer
    llama.cpp names `smollm`) and tokenizer_config.json, from `_smollm2_vocab()`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(v["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in v["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [t for t, kind in zip(v["tokens"], v["types"], strict=True) if int(kind) == 3]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": v["tokens"][v["bos"]],
        "eos_token": v["tokens"][v["eos"]],
        "unk_token": v["tokens"][0],
        "pad_token": v["tokens"][v["eos"]],
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "chat_template": v["chat_template"],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_config(folder: pathlib.Path, shape: Shape, v: dict) -> None:
    from transformers import LlamaConfig

    LlamaConfig(
        **asdict(shape),
        vocab_size=len(v["tokens"]),
        rope_scaling=dict(ROPE_SCALING),
        architectures=["LlamaForCausalLM"],
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=v["bos"],
        eos_token_id=v["eos"],
        torch_dtype="bfloat16",
    ).save_pretrained(folder)


def _layer_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    h, f = shape.hidden_size, shape.intermediate_size
    kv = shape.num_key_value_heads * (h // shape.num_attention_heads)
    return {
        "self_attn.q_proj.weight": (h, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, h),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }


def write_shards(
    folder: pathlib.Path, shards: list[dict[str, tuple[int, ...]]], seed: int = 0
) -> None:
    """One safetensors file a shard (name -> dims), in order, and the index: matrices N(0, 0.02)
    in bfloat16, norms 1. The index is written last: a folder with one is whole."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)

    def tensor(dims: tuple[int, ...]) -> torch.Tensor:
        if len(dims) == 1:
            return torch.ones(dims, dtype=torch.bfloat16)
        return (torch.randn(dims, generator=gen) * 0.02).to(torch.bfloat16)

    weight_map: dict[str, str] = {}
    total = 0
    for idx, names in enumerate(shards):
        file = f"model-{idx + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: tensor(dims) for name, dims in names.items()}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_weights(folder: pathlib.Path, shape: Shape, vocab_size: int, seed: int = 0) -> None:
    """One shard a layer, plus one for the embeddings, norm and head."""
    n = shape.num_hidden_layers
    shards: list[dict[str, tuple[int, ...]]] = [
        {f"model.layers.{i}.{k}": d for k, d in _layer_shapes(shape).items()} for i in range(n)
    ]
    h = shape.hidden_size
    shards.append(
        {
            "model.embed_tokens.weight": (vocab_size, h),
            "model.norm.weight": (h,),
            "lm_head.weight": (vocab_size, h),
        }
    )
    write_shards(folder, shards, seed)


def write_hf_folder(folder: pathlib.Path, shape: Shape = LLAMA_31_8B, seed: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    vocab = _smollm2_vocab()  # read once: the tokenizer, the config and the embeddings' size
    write_tokenizer(folder, vocab)
    write_config(folder, shape, vocab)
    write_weights(folder, shape, len(vocab["tokens"]), seed)


def _run(cmd: list[str], **kwargs) -> None:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, **kwargs)
    print(f"  ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)


def llamacpp_tools() -> tuple[pathlib.Path, pathlib.Path]:
    """(convert_hf_to_gguf.py, llama-quantize) where bench/build_llamacpp.sh keeps them, built
    now if they are not there."""
    from bench.server_proc import REPO_ROOT

    server = pathlib.Path(
        subprocess.run(
            ["bash", str(REPO_ROOT / "bench" / "build_llamacpp.sh")],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    prefix = server.parent.parent
    return prefix / "convert" / "convert_hf_to_gguf.py", prefix / "bin" / "llama-quantize"


def convert_to_bf16(
    convert: pathlib.Path, folder: pathlib.Path, out: pathlib.Path, name: str
) -> None:
    """folder -> out, a bf16 GGUF named `name`, by llama.cpp's convert_hf_to_gguf.py (`convert`);
    renamed into place when whole."""
    # the converter's own gguf-py, not the gguf package the test extras install
    env = {**os.environ, "PYTHONPATH": str(convert.parent / "gguf-py")}
    part = out.with_suffix(".part")
    cmd = [sys.executable, str(convert), str(folder), "--outtype", "bf16"]
    _run([*cmd, "--outfile", str(part), "--model-name", name], env=env)
    part.rename(out)


S = TypeVar("S")


def make_gguf(
    out: pathlib.Path,
    name: str,
    shape: S,
    write_folder: Callable[[pathlib.Path, S], Any],
    keep: bool,
    threads: int,
) -> pathlib.Path:
    """`out`, the Q4_K_M of the Hugging Face folder `write_folder(folder, shape)` writes (a
    dataclass shape), converted and quantized in out's folder. Each step's output is renamed into
    place when whole, so an interrupted run resumes at the step it was in."""
    if out.is_file():
        return out
    work = out.parent / "work"
    folder, bf16 = work / "hf", work / f"{name}-bf16.gguf"
    if not (folder / "model.safetensors.index.json").is_file():  # written last
        print(f"[{name}] writing {folder} ({asdict(shape)})", file=sys.stderr, flush=True)
        start = time.perf_counter()
        write_folder(folder, shape)
        print(f"  ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    convert, quantize = llamacpp_tools()
    if not bf16.is_file():
        convert_to_bf16(convert, folder, bf16, name)
    part = out.with_suffix(".part")
    _run([str(quantize), str(bf16), str(part), "Q4_K_M", str(threads)])
    part.rename(out)
    if not keep:
        shutil.rmtree(work)
    return out


def make(out: pathlib.Path, shape: Shape, keep: bool, threads: int) -> pathlib.Path:
    return make_gguf(out, NAME, shape, write_hf_folder, keep, threads)


def cli(
    argv: list[str] | None,
    module: str,
    doc: str,
    name: str,
    shape: Any,
    write_folder: Callable[[pathlib.Path, Any], Any],
) -> int:
    """`python -m <module>`'s command line (make_8b's, make_moe's): --out, --layers, --keep,
    --threads; prints the GGUF's path."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n")[0])
    p.add_argument("--out", type=pathlib.Path, default=default_path(name))
    p.add_argument(
        "--layers",
        type=int,
        default=shape.num_hidden_layers,
        help=f"fewer layers for a quicker model of the same width (default "
        f"{shape.num_hidden_layers})",
    )
    p.add_argument("--keep", action="store_true", help="keep the HF folder and the bf16 GGUF")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    shape = replace(shape, num_hidden_layers=args.layers)
    print(make_gguf(args.out, name, shape, write_folder, args.keep, args.threads))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli(argv, "bench.make_8b", __doc__ or "", NAME, LLAMA_31_8B, write_hf_folder)


if __name__ == "__main__":
    sys.exit(main())
