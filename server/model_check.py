"""What a model load would fail on that shows without loading: run before a load makes room
(server/model_router.py), so that a missing file or an unsupported model does not cost an idle
model its place under --models-max.

llama.cpp's router starts a child process and learns of a bad model from its exit code, after
the LRU model is gone; here the file's header is read first (the parse is cached for the load,
model/load/gguf_file.py open_shared).
"""

from __future__ import annotations

from pathlib import Path

from model.errors import ModelLoadError


def check_model_path(path: str) -> None:
    """ModelLoadError (with the path and why) for a path that is neither a packaged model's name
    nor a file or folder the loaders read: missing, unreadable, not a GGUF, or an architecture
    (GGUF `general.architecture`, config.json `model_type`) that no loader serves."""
    from model.load.packaged import PACKAGED, PACKAGED_FOLDERS

    if path.lower() in PACKAGED or path.lower() in PACKAGED_FOLDERS:
        return  # resolved (installed on first use) by the load itself
    where = Path(path)
    if where.is_dir():
        _check_folder(where)
    elif where.is_file():
        _check_gguf(where)
    else:
        raise ModelLoadError(f"{path}: no such file or folder")


def _check_gguf(path: Path) -> None:
    from model.load.encoder import ENCODER_ARCHS
    from model.load.gguf import SUPPORTED_ARCHS, open_gguf

    reader = open_gguf(path)  # ModelLoadError: unreadable, truncated, not a GGUF
    arch = reader.fields.get("general.architecture")
    if arch not in (*SUPPORTED_ARCHS, *ENCODER_ARCHS):
        raise ModelLoadError(
            f"{path}: architecture {arch!r} is not supported (supported: "
            f"{', '.join((*SUPPORTED_ARCHS, *ENCODER_ARCHS))})."
        )


def _check_folder(folder: Path) -> None:
    from model.load.encoder import ENCODER_ARCHS
    from model.load.hf_config import SUPPORTED_MODEL_TYPES, read_json

    config = folder / "config.json"
    if not config.is_file():
        raise ModelLoadError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        data = read_json(config)  # ModelLoadError: not JSON
    except OSError as e:
        raise ModelLoadError(f"{config}: cannot read it ({e})") from e
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type not in (*SUPPORTED_MODEL_TYPES, *ENCODER_ARCHS):
        raise ModelLoadError(
            f"{folder}: model_type {model_type!r} is not supported (supported: "
            f"{', '.join((*SUPPORTED_MODEL_TYPES, *ENCODER_ARCHS))})."
        )
