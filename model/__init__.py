"""Model loading, tokenizer, chat template, the Llama-family forward, sampling, the worker."""

from __future__ import annotations

from model.errors import ModelLoadError
from model.load.loader import LoadedModel, default_model_path, load_model

__all__ = ["LoadedModel", "ModelLoadError", "default_model_path", "load_model"]
