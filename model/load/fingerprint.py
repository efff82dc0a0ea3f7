"""A model file's identity, for caches that outlive the process (slot files, the disk tier):
a K/V row computed by one model must never be restored into another.

The fingerprint is a SHA-256 over each weight file's name, size and sampled bytes (the first
and last MiB and 16 pieces of 64 KiB between): it reads ~3 MiB however big the model is, so a
server that starts in seconds stays so. Two different trainings differ everywhere the samples
look; a file edited in one place only is not what this guards against.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_EDGE = 1 << 20
_PIECE = 1 << 16
_PIECES = 16


def _sample(h: hashlib._Hash, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as f:
        if size <= 2 * _EDGE + _PIECES * _PIECE:
            h.update(f.read())
            return
        h.update(f.read(_EDGE))
        step = (size - 2 * _EDGE) // (_PIECES + 1)
        for i in range(1, _PIECES + 1):
            f.seek(_EDGE + i * step)
            h.update(f.read(_PIECE))
        f.seek(size - _EDGE)
        h.update(f.read(_EDGE))


def model_fingerprint(path: str | Path, *adapters: str | Path) -> str:
    """sha256 hex of a model file, or of an HF folder's top-level files (config, tokenizer and
    weights) in name order, then of each LoRA adapter (file or folder) in the order served: a
    cached row names its adapters by their index in that order."""
    h = hashlib.sha256()
    for i, part in enumerate((path, *adapters)):
        part = Path(part)
        if i:
            h.update(f"\0adapter {i - 1}\0".encode())
        files = sorted(p for p in part.iterdir() if p.is_file()) if part.is_dir() else [part]
        for f in files:
            _sample(h, f)
    return h.hexdigest()
