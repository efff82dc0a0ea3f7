"""Which model `python -m bench.run --model` serves to both servers, and what a decode token of
it reads (the c=1 bandwidth figure in bench/summary.py)."""

from __future__ import annotations

import pathlib

from bench import make_8b, make_moe
from model.load.packaged import PACKAGED

__all__ = ["PACKAGED", "decode_read_bytes", "resolve_model"]


def decode_read_bytes(model_path: pathlib.Path | None) -> int | None:
    """The bytes of weights one decode token reads in a GGUF: every layer's (of a mixture of
    experts' stacked *_exps tensors, the expert_used_count it routes to) and the output head's
    (the embedding table only where it is the head: one row otherwise)."""
    from model.load.gguf_file import GGUFFile
    from model.load.loader import default_model_path

    try:
        f = GGUFFile(model_path or default_model_path())
    except Exception:  # noqa: BLE001  (a folder or an unreadable file: no figure)
        return None
    arch = f.fields.get("general.architecture")
    n_experts = int(f.fields.get(f"{arch}.expert_count") or 0)
    n_used = int(f.fields.get(f"{arch}.expert_used_count") or 0)
    read = sum(
        t.n_bytes * n_used // n_experts if n_experts and "_exps." in t.name else t.n_bytes
        for t in f.tensors
        if t.name.startswith("blk.")
    )
    head = f.tensor("output.weight") or f.tensor("token_embd.weight")
    return read + (head.n_bytes if head is not None else 0)


def resolve_model(name: str | None) -> pathlib.Path | None:
    """--model: None (the default model), a packaged model's name, the 8B-shaped or MoE benchmark
    model (bench/make_8b.py, bench/make_moe.py) or a path."""
    if name is None:
        return None
    if name in PACKAGED:
        return PACKAGED[name].path()
    for maker in (make_8b, make_moe):
        if name == maker.NAME:
            made = make_8b.default_path(name)
            if not made.is_file():
                module = maker.__name__
                raise SystemExit(f"--model {name}: not made yet; `python -m {module}` makes it")
            return made
    path = pathlib.Path(name)
    if not path.exists():
        raise SystemExit(f"--model {name}: no such file, and not one of {', '.join(PACKAGED)}")
    return path
