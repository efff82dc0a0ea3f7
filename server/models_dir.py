"""The models a multi-model server offers (`--models-dir`, `--model NAME=PATH`), by name.

llama.cpp's router mode finds them the same way: a GGUF file in the folder is a model named
by its file name without `.gguf` (a split model by its first shard, `-00001-of-0000N`), and a
sub-folder is a model named by the folder: a Hugging Face folder (config.json), or a folder
holding the GGUF file(s) of one model. Multimodal projectors (`mmproj*`) and LoRA adapters
(adapter_config.json) are not models.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from server.settings import Settings

_SHARD = re.compile(r"-(\d{5})-of-(\d{5})$")


@dataclass(frozen=True, slots=True)
class ModelSource:
    name: str
    path: str  # what load_backend opens: a GGUF file or a HF folder


def _gguf_model(path: Path) -> tuple[str, Path] | None:
    """(name, file) of a GGUF that starts a model, None for a projector or a later shard."""
    stem = path.stem
    if path.suffix.lower() != ".gguf" or stem.lower().startswith("mmproj"):
        return None
    shard = _SHARD.search(stem)
    if shard is not None:
        if int(shard.group(1)) != 1:
            return None
        stem = stem[: shard.start()]
    return stem, path


def _folder_model(folder: Path) -> Path | None:
    if (folder / "adapter_config.json").is_file():
        return None
    if (folder / "config.json").is_file():
        return folder
    firsts = sorted(g[1] for f in folder.glob("*.gguf") if (g := _gguf_model(f)) is not None)
    return firsts[0] if len(firsts) == 1 else None


def scan_models_dir(folder: str) -> list[ModelSource]:
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"--models-dir {folder}: not a folder")
    found = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            path = _folder_model(entry)
            if path is not None:
                found.append(ModelSource(entry.name, str(path)))
        elif (g := _gguf_model(entry)) is not None:
            found.append(ModelSource(g[0], str(g[1])))
    return found


def _named(spec: str) -> ModelSource:
    """ "NAME=PATH" (or a plain PATH, named by its file or folder)."""
    name, sep, path = spec.partition("=")
    if not sep or Path(spec).exists():
        name, path = "", spec
    name = name or Path(path).name.removesuffix(".gguf")
    return ModelSource(name, path)


def model_sources(settings: Settings) -> list[ModelSource]:
    """Every model the server offers, in listing order; ValueError for a missing path (that is
    no packaged model's name either), two models with one name, or none at all."""
    from model.load.packaged import PACKAGED, PACKAGED_FOLDERS

    sources = [_named(spec) for spec in settings.models]
    if settings.model:
        sources.append(_named(settings.model))
    for source in sources:
        packaged = source.path.lower() in PACKAGED or source.path.lower() in PACKAGED_FOLDERS
        if not packaged and not Path(source.path).exists():
            raise ValueError(f"--model {source.name}={source.path}: no such file or folder")
    if settings.models_dir:
        sources += scan_models_dir(settings.models_dir)
    names = [s.name for s in sources]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ValueError(f"two models with one name: {clash} (name them with --model NAME=PATH)")
    if not sources:
        raise ValueError(f"--models-dir {settings.models_dir}: no GGUF file or model folder")
    return sources
