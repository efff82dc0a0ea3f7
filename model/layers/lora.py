"""LoRA adapters served over one base model, several in one batch (vLLM's punica idea).

Each adapted linear of the base becomes a LoraLinear: the base module (float, int4/int8,
GGUF blocks: whatever kernel it runs) computes every row, then the rows with a LoRA selection
get their low-rank deltas, every adapter of the step at once:

    h = x[rows] @ A.T                   # [m, n_ad * R]: each adapter's A x, stacked
    h = h * W                           # [m, n_ad, R]: row i's weight of adapter a (0: unused)
    y[rows, lo:hi] += h @ B.T           # [m, hi - lo]: sum over the row's adapters of B (A x)

A [n_ad * R, k] stacks every adapter's A (the parts of a fused q|k|v or gate|up linear one
under the other, ranks zero-padded to R), B [hi - lo, n_ad * R] their B (block-diagonal over
the parts, over the span of outputs any adapter touches), W[i, a] = the row's scale of adapter
a times a's scaling on this linear. So a step costs the same few ops per linear whatever its
mix of adapters (punica's SGMV as two dense GEMMs; the zero blocks add exact zeros); where
n_ad * R is large only the adapters the step uses are gathered. Rows without a selection are
not touched, so a base-model request computes what it computes without adapters loaded.

A selection (`LoraKey`) is llama.cpp's per-request `lora` list: (adapter id, scale) pairs,
sorted by id, zero scales left out; `()` is the base model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
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


# Past this many stacked rank columns (adapters x R) a step gathers the adapters it uses
# instead of multiplying by all of them.
ALL_ADAPTERS_MAX_COLS = 256


@dataclass(slots=True)
class LoraBatch:
    """A step's rows with a selection and each one's weight per adapter."""

    rows: slice | torch.Tensor  # the rows with adapters: a slice when they are one run
    weights: torch.Tensor  # [m, n_used] float32: row i's scale of used adapter j
    used: torch.Tensor | None  # [n_used] int64 packed slots; None: every adapter, in order


@dataclass(slots=True)
class _Step:
    batch: LoraBatch | None = None  # None: no row of this step has an adapter


class LoraLinear(nn.Module):
    """base(x) + the step's LoRA deltas on its rows (module doc)."""

    def __init__(
        self, base: nn.Module, sizes: list[int], n_adapters: int, rank: int, step: _Step
    ) -> None:
        super().__init__()
        self.base = base
        self.bounds = []  # (offset, size) of each fused part's outputs
        offset = 0
        for n in sizes:
            self.bounds.append((offset, n))
            offset += n
        self.n_adapters, self.rank = n_adapters, rank
        self.step = step
        self.lo, self.hi = offset, 0  # the span of outputs any adapter touches
        # adapter id -> its (part, A [r, k], B [n_part, r], scaling) until pack()
        self._pairs: dict[int, list[tuple[int, torch.Tensor, torch.Tensor, float]]] = {}

    def add(self, adapter: int, pairs: list[tuple[int, torch.Tensor, torch.Tensor, float]]) -> None:
        self._pairs[adapter] = sorted(pairs, key=lambda p: p[0])
        for part, *_ in pairs:
            off, n = self.bounds[part]
            self.lo, self.hi = min(self.lo, off), max(self.hi, off + n)

    def pack(self, like: torch.Tensor) -> None:
        """Stack the pairs (module doc) as buffers: .to(device) moves them, weight_bytes
        counts them."""
        n_ad, rank = self.n_adapters, self.rank
        k = next(iter(self._pairs.values()))[0][1].shape[1]
        a = like.new_zeros(n_ad, rank, k)
        b = like.new_zeros(self.hi - self.lo, n_ad, rank)
        scaling = torch.ones(n_ad, dtype=torch.float32, device=like.device)
        for aid, pairs in self._pairs.items():
            col = 0
            for part, pa, pb, _ in pairs:
                off, n = self.bounds[part]
                r = pa.shape[0]
                a[aid, col : col + r] = pa
                b[off - self.lo : off - self.lo + n, aid, col : col + r] = pb
                col += r
            # NOTE: PEFT's parts share one scaling; a GGUF's may not (rank per tensor): then
            # each part's B carries its own and the adapter's is 1
            if len({s for *_, s in pairs}) == 1:
                scaling[aid] = pairs[0][3]
            else:
                for part, _, _, s in pairs:
                    off, n = self.bounds[part]
                    rows = slice(off - self.lo, off - self.lo + n)
                    b[rows, aid] *= s
        self.register_buffer("lora_a", a.view(n_ad * rank, k), persistent=False)
        self.register_buffer("lora_b", b.view(self.hi - self.lo, n_ad * rank), persistent=False)
        self.register_buffer("lora_scaling", scaling, persistent=False)
        self._pairs = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.step.batch
        if batch is None:
            return y
        a, b, scaling = self.lora_a, self.lora_b, self.lora_scaling
        if batch.used is not None:
            n_ad, rank = self.n_adapters, self.rank
            a = a.view(n_ad, rank, -1)[batch.used].flatten(0, 1)
            b = b.view(-1, n_ad, rank)[:, batch.used].flatten(1, 2)
            scaling = scaling[batch.used]
        xs = x[batch.rows]  # [m, k]
        m = xs.shape[0]
        h = (xs @ a.T).view(m, -1, self.rank)  # [m, n_used, R]
        w = batch.weights * scaling  # [m, n_used] float32
        h = (h.float() * w[:, :, None]).to(xs.dtype)  # one rounding of the scaled A x
        delta = h.view(m, -1) @ b.T  # [m, hi - lo]
        y[batch.rows, self.lo : self.hi] += delta
        return y


# (module attribute path from a Block, the parts it fuses)
_TARGETS = (
    (("mixer", "wqkv"), ("wq", "wk", "wv")),
    (("mixer", "wo"), ("wo",)),
    (("feed_forward", "w13"), ("w1", "w3")),
    (("feed_forward", "w2"), ("w2",)),
)


class LoraSet:
    """The adapters a model serves, attached to its linears; `active(batch)` routes one step's
    rows. Adapters keep the ids they are served under (llama.cpp's 0..n-1 at start-up, then
    the runtime loads': server/lora_runtime.py); `slots` maps an id to its packed place."""

    def __init__(
        self, model: Any, adapters: Sequence[LoraAdapter] | Mapping[int, LoraAdapter]
    ) -> None:
        by_id = dict(adapters) if isinstance(adapters, Mapping) else dict(enumerate(adapters))
        self.by_id = by_id
        self.adapters = list(by_id.values())
        self.slots = {aid: slot for slot, aid in enumerate(by_id)}
        self._step = _Step()
        self.linears: list[LoraLinear] = []
        self._owners: list[tuple[Any, str]] = []  # where each LoraLinear sits (detach)
        # R: the largest rank any adapter has on a linear (its fused parts' ranks summed)
        rank = max(
            (
                sum(
                    a.weights[f"layers.{i}.{p}"].a.shape[0]
                    for p in parts
                    if f"layers.{i}.{p}" in a.weights
                )
                for a in self.adapters
                for i in range(len(model.layers))
                for _, parts in _TARGETS
            ),
            default=0,
        )
        self.rank = rank
        dev, like = model.device, model.norm.weight
        for i, block in enumerate(model.layers):
            for (owner_name, attr), parts in _TARGETS:
                names = [f"layers.{i}.{p}" for p in parts]
                if not any(n in a.weights for a in self.adapters for n in names):
                    continue
                owner = getattr(block, owner_name)
                sizes = [_part_size(model.args, p) for p in parts]
                lin = LoraLinear(getattr(owner, attr), sizes, len(self.adapters), rank, self._step)
                for slot, adapter in enumerate(self.adapters):
                    ws = [(j, adapter.weights.get(n)) for j, n in enumerate(names)]
                    pairs = [(j, w.a.to(dev), w.b.to(dev), w.scaling) for j, w in ws if w]
                    if pairs:
                        lin.add(slot, pairs)
                lin.pack(like)
                self.linears.append(lin)
                self._owners.append((owner, attr))
        self.attach()  # NOTE: only once every linear is packed: a failure leaves the model as is

    def attach(self) -> None:
        """Put the LoraLinears in the model; call between steps."""
        for (owner, attr), lin in zip(self._owners, self.linears, strict=True):
            setattr(owner, attr, lin)

    def detach(self) -> None:
        """Put the base linears back (before another LoraSet attaches to the model); call
        between steps."""
        for (owner, attr), lin in zip(self._owners, self.linears, strict=True):
            setattr(owner, attr, lin.base)

    def __len__(self) -> int:
        return len(self.adapters)

    def batch(self, seqs: Sequence[LoraRows], device: torch.device) -> LoraBatch | None:
        """The step's LoRA rows and weights; None when every row is the base model's."""
        spans: list[tuple[int, int]] = []
        keys: list[LoraKey] = []
        for s in seqs:
            if not s.lora:
                continue
            if spans and spans[-1][1] == s.start and keys[-1] == s.lora:
                spans[-1] = (spans[-1][0], s.end)
            else:
                spans.append((s.start, s.end))
                keys.append(s.lora)
        if not spans:
            return None
        used_ids = sorted({aid for key in keys for aid, _ in key})
        missing = [aid for aid in used_ids if aid not in self.slots]
        if missing:  # NOTE: never run such rows as the base model (isolate() fails them alone)
            raise LookupError(f"LoRA adapter id {missing[0]} is not loaded (unloaded?)")
        used_slots = sorted(self.slots[aid] for aid in used_ids)
        gather = len(self.adapters) * self.rank > ALL_ADAPTERS_MAX_COLS
        cols = {s: j for j, s in enumerate(used_slots if gather else range(len(self.adapters)))}
        m = sum(e - s for s, e in spans)
        weights = torch.zeros(m, len(cols), dtype=torch.float32)
        row = 0
        for (start, end), key in zip(spans, keys, strict=True):
            for aid, scale in key:
                weights[row : row + end - start, cols[self.slots[aid]]] = scale
            row += end - start
        if len(spans) == 1:
            rows: slice | torch.Tensor = slice(*spans[0])
        else:
            rows = torch.cat([torch.arange(s, e) for s, e in spans]).to(device)
        used = torch.tensor(used_slots, dtype=torch.int64, device=device) if gather else None
        return LoraBatch(rows, weights.to(device), used)

    @contextmanager
    def active(self, batch: LoraBatch | None) -> Iterator[None]:
        self._step.batch = batch
        try:
            yield
        finally:
            self._step.batch = None


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
