"""What each layer of a model keeps per sequence: the per-layer memory spec.

The model declares one spec per layer; the scheduler's Memory (metadata: cells, slots) and the
worker's storage (tensors) are both built from it, as vLLM builds both from one
KVCacheConfig and llama.cpp from the model's layer filter. No torch here: the scheduler
imports this module.

Layers with the same memory key share one pool of cells (or slots): every full-attention
layer reads the same cells, every sliding-window layer of one window the same (smaller)
pool, every recurrent layer the same slot of a sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Attention:
    """K/V per token. `window` 0: full attention. `window` W > 0: a row at position p sees
    the positions in (p - W, p] (Gemma, Mistral SWA: `kv_pos > p - W`), so a cell leaves a
    sequence's window once its position is W or more behind the sequence's newest one."""

    n_kv_heads: int
    head_dim: int
    window: int = 0

    @property
    def key(self) -> str:
        return "full" if self.window == 0 else f"swa{self.window}"

    def visible(self, kv_pos: int, q_pos: int) -> bool:
        """Whether a row at q_pos reads the cell at kv_pos (causal, and inside the window)."""
        return kv_pos <= q_pos and (self.window == 0 or kv_pos > q_pos - self.window)


@dataclass(frozen=True, slots=True)
class Recurrent:
    """A fixed-size state per sequence (Mamba-style: convolution state + SSM state).
    `shapes`: one sequence's state tensors of this layer, e.g. ((d_conv - 1, conv_dim),
    (n_heads, head_dim, d_state))."""

    shapes: tuple[tuple[int, ...], ...]

    @property
    def key(self) -> str:
        return "recurrent"


LayerSpec = Attention | Recurrent


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """The layers that share one pool; `spec` is the first layer's (same key for all)."""

    key: str
    layers: tuple[int, ...]
    spec: LayerSpec


@dataclass(frozen=True, slots=True)
class MemorySpec:
    layers: tuple[LayerSpec, ...]

    @staticmethod
    def of(layers: Sequence[LayerSpec]) -> MemorySpec:
        return MemorySpec(tuple(layers))

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        """One group per memory key, in order of first appearance ("full" first if any)."""
        order: dict[str, list[int]] = {}
        for i, spec in enumerate(self.layers):
            order.setdefault(spec.key, []).append(i)
        keys = sorted(order, key=lambda k: (k != "full", order[k][0]))
        return tuple(LayerGroup(k, tuple(order[k]), self.layers[order[k][0]]) for k in keys)

    @property
    def windows(self) -> tuple[int, ...]:
        """Per group (in `groups` order), its layers' window: 0 for full attention and for
        the recurrent group (what a BatchPlan's GroupBatch.window holds)."""
        return tuple(g.spec.window if isinstance(g.spec, Attention) else 0 for g in self.groups)

    def group_of(self, layer: int) -> int:
        """Index into `groups` of the group that holds `layer`."""
        key = self.layers[layer].key
        return next(i for i, g in enumerate(self.groups) if g.key == key)

    @property
    def max_window(self) -> int:
        """The largest window of any sliding-window layer; 0 if there is none."""
        return max((s.window for s in self.layers if isinstance(s, Attention)), default=0)

    @property
    def has_full_attention(self) -> bool:
        return any(isinstance(s, Attention) and s.window == 0 for s in self.layers)

    @property
    def has_recurrent(self) -> bool:
        return any(isinstance(s, Recurrent) for s in self.layers)
