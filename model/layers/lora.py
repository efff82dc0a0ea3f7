"""LoRA adapters served over one base model, several in one batch (vLLM's punica idea).

Each adapted linear of the base becomes a LoraLinear: the base module (float, int4/int8,
GGUF blocks: whatever kernel it runs) computes every row, then per group of rows that share a
LoRA selection each selected adapter adds scale * scaling * B (A x) to its part of the output
(a fused q|k|v or gate|up linear: each part its own pair). A step's row groups (`LoraGroup`)
come from the plan's sequences; rows with no selection get nothing added, so a base-model
request computes exactly what it computes without adapters loaded.

A selection (`LoraKey`) is llama.cpp's per-request `lora` list: (adapter id, scale) pairs,
sorted by id, zero scales left out; `()` is the base model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from model.load.lora import LoraAdapter

LoraKey = tuple[tuple[int, float], ...]


class LoraRows(Protocol):
    """A sequence's rows of a step and its selection (scheduler.plan.SeqBatch)."""

    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def lora(self) -> LoraKey: ...


@dataclass(slots=True)
class LoraGroup:
    """Rows of a step that share a selection: a slice when they are one run, else an index."""

    rows: slice | torch.Tensor
    lora: LoraKey


@dataclass(slots=True)
class _Step:
    groups: list[LoraGroup] | None = None  # None: no row of this step has an adapter


class LoraLinear(nn.Module):
    """base(x), plus each group's adapters' low-rank deltas on its rows."""

    def __init__(self, base: nn.Module, parts: list[str], sizes: list[int], step: _Step) -> None:
        super().__init__()
        self.base = base
        self.parts = parts  # weight kinds, in output order ("wq", "wk", "wv")
        self.bounds = []  # (offset, size) of each part's outputs
        offset = 0
        for n in sizes:
            self.bounds.append((offset, n))
            offset += n
        self.step = step
        # adapter id -> [(part index, buffer name of A [r, k] (+ "_a") and B [n_part, r]
        # (+ "_b"), scaling)]: buffers, so that .to(device) moves them and weight_bytes counts
        self.pairs: dict[int, list[tuple[int, str, float]]] = {}

    def add(
        self, adapter: int, part: int, a: torch.Tensor, b: torch.Tensor, scaling: float
    ) -> None:
        """Adapter `adapter`'s pair for part `part`."""
        name = f"lora{adapter}_{part}"
        self.register_buffer(name + "_a", a, persistent=False)
        self.register_buffer(name + "_b", b, persistent=False)
        self.pairs.setdefault(adapter, []).append((part, name, scaling))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        groups = self.step.groups
        if not groups:
            return y
        for g in groups:
            xs = x[g.rows]  # [m, k]
            for adapter, scale in g.lora:
                for part, name, scaling in self.pairs.get(adapter, ()):
                    a, b = self._buffers[name + "_a"], self._buffers[name + "_b"]
                    assert a is not None and b is not None
                    off, n = self.bounds[part]
                    # NOTE: PEFT's order: lora_B(lora_A(x)) * scaling
                    delta = (xs @ a.T) @ b.T * (scaling * scale)  # [m, n]
                    y[g.rows, off : off + n] += delta
        return y


# (module attribute path from a Block, the parts it fuses)
_TARGETS = (
    (("attention", "wqkv"), ("wq", "wk", "wv")),
    (("attention", "wo"), ("wo",)),
    (("feed_forward", "w13"), ("w1", "w3")),
    (("feed_forward", "w2"), ("w2",)),
)


class LoraSet:
    """The adapters a model serves (ids 0..n-1 in load order, llama.cpp's), attached to its
    linears; `active(groups)` routes one step's rows."""

    def __init__(self, model: Any, adapters: Sequence[LoraAdapter]) -> None:
        self.adapters = list(adapters)
        self._step = _Step()
        self.linears: list[LoraLinear] = []
        for i, block in enumerate(model.layers):
            for (owner_name, attr), parts in _TARGETS:
                names = [f"layers.{i}.{p}" for p in parts]
                if not any(n in a.weights for a in self.adapters for n in names):
                    continue
                owner = getattr(block, owner_name)
                base = getattr(owner, attr)
                sizes = [_part_size(model.args, p) for p in parts]
                lin = LoraLinear(base, list(parts), sizes, self._step)
                for aid, adapter in enumerate(self.adapters):
                    for j, name in enumerate(names):
                        w = adapter.weights.get(name)
                        if w is not None:
                            dev = model.device
                            lin.add(aid, j, w.a.to(dev), w.b.to(dev), w.scaling)
                setattr(owner, attr, lin)
                self.linears.append(lin)

    def __len__(self) -> int:
        return len(self.adapters)

    def groups(self, seqs: Sequence[LoraRows], device: torch.device) -> list[LoraGroup] | None:
        """The step's row groups with a selection; None when every row is the base model's."""
        runs: dict[LoraKey, list[tuple[int, int]]] = {}
        for s in seqs:
            if s.lora:
                spans = runs.setdefault(s.lora, [])
                if spans and spans[-1][1] == s.start:
                    spans[-1] = (spans[-1][0], s.end)
                else:
                    spans.append((s.start, s.end))
        if not runs:
            return None
        out = []
        for key, spans in runs.items():
            if len(spans) == 1:
                out.append(LoraGroup(slice(*spans[0]), key))
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(device)
                out.append(LoraGroup(rows, key))
        return out

    @contextmanager
    def active(self, groups: list[LoraGroup] | None) -> Iterator[None]:
        self._step.groups = groups
        try:
            yield
        finally:
            self._step.groups = None


def _part_size(args: Any, kind: str) -> int:
    if kind == "wq":
        return int(args.n_heads * args.head_dim)
    if kind in ("wk", "wv"):
        return int(args.n_kv_heads * args.head_dim)
    if kind in ("wo", "w2"):
        return int(args.dim)
    return int(args.hidden_dim)


def unwrap(linear: Any) -> Any:
    """The base linear under a LoraLinear (what the C++ step runs)."""
    return linear.base if isinstance(linear, LoraLinear) else linear
