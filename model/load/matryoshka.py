"""Which shortened vectors an embedding model declares it was trained for (Matryoshka
Representation Learning, arXiv:2205.13147): the `dimensions` of /v1/embeddings it serves.

As vLLM decides it (ModelConfig.is_matryoshka / matryoshka_dimensions), from config.json only:
`matryoshka_dimensions` (a list: exactly those sizes) or `is_matryoshka: true` (any size up to
the full one). Nothing else declares it: sentence-transformers' files do not (its
`truncate_dim` is a default cut, not a list of trained sizes), nor does llama.cpp's GGUF (its
converter writes no such key), nor does a model card's prose ("768, 512, 256 or 128").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class Matryoshka:
    dims: tuple[int, ...]  # the sizes config.json lists, ascending; () with any_size
    any_size: bool = False  # is_matryoshka without a list: every size from 1 to the full one

    def allows(self, n: int, full: int) -> bool:
        """Whether a vector of `full` values may be cut to its first `n`."""
        return 1 <= n <= full and (self.any_size or n in self.dims or n == full)

    def describe(self, full: int) -> str:
        if self.any_size:
            return f"any size from 1 to {full}"
        return ", ".join(str(n) for n in sorted({*self.dims, full}))


def read_matryoshka(config: dict[str, Any], full: int, where: Path) -> Matryoshka | None:
    """config.json's declaration for vectors of `full` values; None: it declares none."""
    listed = config.get("matryoshka_dimensions")
    if listed:
        if not isinstance(listed, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= full for n in listed
        ):
            raise ModelLoadError(
                f"{where}: matryoshka_dimensions {listed!r} is not a list of sizes from 1 to "
                f"the model's {full}."
            )
        return Matryoshka(tuple(sorted(set(listed))))
    if config.get("is_matryoshka") is True:
        return Matryoshka((), any_size=True)
    return None
