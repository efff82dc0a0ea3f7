"""KVStorage: the K/V tensors behind KVCells (torch). K is stored after RoPE; the deferred
K-shift (llama.cpp's `build_k_shift`) re-rotates stored K rows with kvcache.rope.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache.cache_types import CacheType, cache_type
from kvcache.cell_file import rows_geometry
from kvcache.cells import PendingOps
from kvcache.rope import RopeConfig, apply_rope
from kvcache.rotation import hadamard, k_center, rotation_size
from kvcache.state_storage import RecurrentStorage
from kvcache.zeros import lazy_zeros


class KVStorage:
    """K and V for every layer and cell: k, v: [n_layers, n_kv_heads, n_cells, row_len].

    Head-major, so that a gather of cells is [n_kv_heads, n, head_dim] contiguous: attention
    batches over (kv head, sequence) and reads it without another copy. Each of K and V has a
    cache type (kvcache.cache_types: f32, f16, bf16, q8_0, q4_0): a float type stores rows of
    head_dim values in its dtype, a quantized one rows of bytes (uint8 [..., row_bytes]); either
    way dim 2 is the cell, so copying cells out and in (read_cells / write_cells, or k / v
    indexed along dim 2) works for every type. `dtype` is what reads return (the model's).
    """

    def __init__(
        self,
        n_layers: int,
        n_cells: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        rope: RopeConfig | None = None,
        layer_ropes: list[RopeConfig] | None = None,
        type_k: str | CacheType | None = None,
        type_v: str | CacheType | None = None,
        rotate: bool | None = None,
    ) -> None:
        """`layer_ropes`: each layer's RoPE when they differ (Gemma 3's local and global bases);
        the K-shift rotates each layer by its own. `type_k` / `type_v`: the cache types (None:
        `dtype`'s float type). `rotate`: whether quantized types store Hadamard-rotated rows
        (kvcache/rotation.py; None: CELLSERVE_KV_ROTATION, on by default)."""
        self.n_layers = n_layers
        self.n_cells = n_cells
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.type_k = cache_type(dtype if type_k is None else type_k)
        self.type_v = cache_type(dtype if type_v is None else type_v)
        self.type_k.check(head_dim)
        self.type_v.check(head_dim)
        # > 0: the attention layers store H_n k / H_n v rows of this n (kvcache/rotation.py)
        self.rot_k = rotation_size(self.type_k, head_dim, rotate)
        self.rot_v = rotation_size(self.type_v, head_dim, rotate, v=True)
        # per layer, the constant its quantized K rows are stored less of (center_k)
        self.k_centers: dict[int, torch.Tensor] = {}
        self._k_center_cast: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self.device = torch.device(device)
        self.rope = rope if rope is not None else RopeConfig(theta=10000.0, dim=head_dim)
        self.layer_ropes = layer_ropes or [self.rope] * n_layers
        self.k = self._zeros(self.type_k)
        self.v = self._zeros(self.type_v)

    def _zeros(self, t: CacheType) -> torch.Tensor:
        shape = (self.n_layers, self.n_kv_heads, self.n_cells, t.row_len(self.head_dim))
        return lazy_zeros(shape, t.storage_dtype, self.device)

    @property
    def bytes_per_cell(self) -> int:
        per_head = self.type_k.row_bytes(self.head_dim) + self.type_v.row_bytes(self.head_dim)
        return self.n_layers * self.n_kv_heads * per_head

    @property
    def native(self) -> bool:
        """K and V stored as the model's own dtype: reads are views, no conversion."""
        return self.type_k.dtype == self.dtype and self.type_v.dtype == self.dtype

    def geometry(self) -> dict[str, object]:
        """What its rows look like (kvcache/cell_file.py: a restore checks a file's against it)."""
        return rows_geometry(self.k, self.v, self.rot_k, self.rot_v, bool(self.k_centers))

    def center_k(self, layer: int, bias_k: torch.Tensor, n_positions: int) -> None:
        """Store `layer`'s K rows less kvcache.rotation.k_center of its K bias [n_kv_heads,
        head_dim] (the attention layers subtract k_center(layer) before the cells; only where
        they are rotated quantized rows). Call before any row is written."""
        if self.rot_k:
            c = k_center(bias_k, self.layer_ropes[layer], n_positions)
            # rounded to the activations' dtype: what the layers subtract, and the K-shift adds
            self.k_centers[layer] = c.to(self.dtype).float().to(self.device)
            self._k_center_cast.clear()

    def k_center(self, layer: int, dtype: torch.dtype) -> torch.Tensor | None:
        """What `layer`'s K rows are stored less of, [n_kv_heads, head_dim] in `dtype`."""
        c = self.k_centers.get(layer)
        if c is None or c.dtype == dtype:
            return c
        key = (layer, dtype)  # cast once: the layers ask every step
        if key not in self._k_center_cast:
            self._k_center_cast[key] = c.to(dtype)
        return self._k_center_cast[key]

    def write(self, layer: int, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v: [n, n_kv_heads, head_dim] into `cells` [n] (int64) of `layer`."""
        k, v = self.type_k.encode(k), self.type_v.encode(v)
        self.k[layer].index_copy_(1, cells, k.transpose(0, 1))
        self.v[layer].index_copy_(1, cells, v.transpose(0, 1))

    def read_cells(self, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored rows of `cells` [n] (int64), as stored (any cache type):
        k, v: [n_layers, n_kv_heads, n, row_len], copies; write_cells puts them back."""
        return self.k.index_select(2, cells), self.v.index_select(2, cells)

    def write_cells(self, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put rows that read_cells returned (of a storage of the same shape and types) into
        `cells` [n]."""
        assert k.dtype == self.k.dtype and v.dtype == self.v.dtype, "rows of another cache type"
        self.k.index_copy_(2, cells, k)
        self.v.index_copy_(2, cells, v)

    def head_index(self, cells: torch.Tensor) -> torch.Tensor:
        """cells [n] -> [n_kv_heads * n] rows of a layer's [n_kv_heads * n_cells, head_dim] view,
        head-major: built once per batch, used by gather_heads in every layer."""
        heads = torch.arange(self.n_kv_heads, dtype=torch.int64, device=cells.device)
        return (heads[:, None] * self.n_cells + cells[None, :]).reshape(-1)

    def read_index(self, cells: np.ndarray) -> torch.Tensor | slice:
        """What gather_heads takes for `cells` [n]: a slice when they are one increasing run
        (a lone sequence's cells usually are: read in place, no copy), else head_index."""
        n = len(cells)
        if n and int(cells[-1]) - int(cells[0]) == n - 1 and bool(np.all(np.diff(cells) == 1)):
            return slice(int(cells[0]), int(cells[0]) + n)
        index = torch.from_numpy(np.ascontiguousarray(cells, dtype=np.int64)).to(self.device)
        return self.head_index(index)

    def gather_heads(
        self, layer: int, index: torch.Tensor | slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """index from head_index(cells) or read_index -> k, v: [n_kv_heads, n, head_dim] in
        `dtype` (contiguous for an index tensor; views of the cache for a slice when the type
        stores `dtype` itself; other types are converted or dequantized).

        NOTE: a dim-0 gather of whole rows: index_select along the cell dim (1) ran 2x slower.
        """
        return self._gather(self.k[layer], self.type_k, index), self._gather(
            self.v[layer], self.type_v, index
        )

    def _gather(
        self, rows: torch.Tensor, t: CacheType, index: torch.Tensor | slice
    ) -> torch.Tensor:
        """rows: one layer's [n_kv_heads, n_cells, row_len]."""
        if isinstance(index, slice):
            raw = rows[:, index]
        else:
            raw = rows.view(-1, rows.shape[-1]).index_select(0, index)
            raw = raw.view(self.n_kv_heads, -1, rows.shape[-1])
        return t.decode(raw, self.dtype)

    def gather(self, layer: int, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> k, v: [n, n_kv_heads, head_dim] (views of gather_heads) of `cells` of `layer`."""
        k, v = self.gather_heads(layer, self.head_index(cells))
        return k.transpose(0, 1), v.transpose(0, 1)

    def apply(self, pending: PendingOps) -> None:
        """Apply the cells' deferred work: copies first (in order), then K-shifts."""
        src_list, dst_list = pending.copy_src.tolist(), pending.copy_dst.tolist()
        if src_list and set(src_list).isdisjoint(dst_list):  # no chains: one gather suffices
            src = torch.as_tensor(src_list, dtype=torch.int64, device=self.device)
            dst = torch.as_tensor(dst_list, dtype=torch.int64, device=self.device)
            self.k.index_copy_(2, dst, self.k.index_select(2, src))
            self.v.index_copy_(2, dst, self.v.index_select(2, src))
        else:
            for s, d in zip(src_list, dst_list, strict=True):
                self.k[:, :, d] = self.k[:, :, s]
                self.v[:, :, d] = self.v[:, :, s]
        if pending.shift_cells.size == 0:
            return
        cells = torch.as_tensor(pending.shift_cells, dtype=torch.int64, device=self.device)
        deltas = torch.as_tensor(pending.shift_deltas, dtype=torch.int64, device=self.device)
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, rope in enumerate(self.layer_ropes):
            if id(rope) not in tables:
                tables[id(rope)] = rope.cos_sin(deltas)
            cos, sin = tables[id(rope)]
            raw = self.k[layer].index_select(1, cells).transpose(0, 1)  # [n, n_kv_heads, row]
            # a quantized row: dequantize, rotate, quantize again (only the shifted cells)
            k = self.type_k.decode(raw, torch.float32) if self.type_k.quantized else raw
            if self.rot_k:  # RoPE turns k, not H (k - c): H is its own inverse
                k = hadamard(k, self.rot_k)
            c = self.k_centers.get(layer)
            k = apply_rope(k if c is None else k + c, cos, sin, rope.layout)
            if c is not None:
                k = k - c
            if self.rot_k:
                k = hadamard(k, self.rot_k)
            rotated = self.type_k.encode(k)
            self.k[layer].index_copy_(1, cells, rotated.transpose(0, 1))

    def clear(self) -> None:
        self.k.zero_()
        self.v.zero_()


class GroupedKVStorage:
    """The K/V of a model whose layer groups (kvcache.spec.MemorySpec.groups) each have their
    own pool of cells: one KVStorage per group, sized by its pool and K-shifted with its
    group's RoPE, or a RecurrentStorage for the recurrent group (its slots' states). Reads and
    writes take the model's layer index, so attention code written for one KVStorage works
    unchanged; `k[layer]` / `v[layer]` are an attention layer's [n_kv_heads, n_cells of its
    group, head_dim] tensors; `state` is the recurrent layers' storage (None without)."""

    def __init__(
        self, groups: list[KVStorage | RecurrentStorage], layers: list[tuple[int, ...]]
    ) -> None:
        assert len(groups) == len(layers) and groups
        self.groups = groups
        self._where = {layer: (g, i) for g, ls in enumerate(layers) for i, layer in enumerate(ls)}
        order = sorted(self._where)
        assert order == list(range(len(order))), "every layer in exactly one group"
        states = [s for s in groups if isinstance(s, RecurrentStorage)]
        assert len(states) <= 1, "one recurrent group"
        self.state = states[0] if states else None
        self.dtype = groups[0].dtype
        self.device = groups[0].device
        kv = [s for s in groups if isinstance(s, KVStorage)]
        self.type_k = kv[0].type_k if kv else None
        self.type_v = kv[0].type_v if kv else None
        self.rot_k = kv[0].rot_k if kv else 0
        self.rot_v = kv[0].rot_v if kv else 0
        assert all((s.rot_k, s.rot_v) == (self.rot_k, self.rot_v) for s in kv), "one rotation"
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for layer in order:
            g, i = self._where[layer]
            part = groups[g]
            if isinstance(part, KVStorage):
                self.k[layer], self.v[layer] = part.k[i], part.v[i]

    @property
    def native(self) -> bool:
        """Every K/V pool stores the model's own dtype (KVStorage.native)."""
        return all(s.native for s in self.groups if isinstance(s, KVStorage))

    @property
    def bytes_per_cell(self) -> int:
        """K and V of one cell of every pool (one token's, where every pool holds it)."""
        return sum(s.bytes_per_cell for s in self.groups if isinstance(s, KVStorage))

    @property
    def num_bytes(self) -> int:
        return sum(
            s.bytes_per_cell * s.n_cells if isinstance(s, KVStorage) else s.num_bytes
            for s in self.groups
        )

    def _kv(self, layer: int) -> tuple[KVStorage, int]:
        g, i = self._where[layer]
        part = self.groups[g]
        assert isinstance(part, KVStorage), f"layer {layer} has no K/V (a recurrent layer)"
        return part, i

    def center_k(self, layer: int, bias_k: torch.Tensor, n_positions: int) -> None:
        part, i = self._kv(layer)
        part.center_k(i, bias_k, n_positions)

    def k_center(self, layer: int, dtype: torch.dtype) -> torch.Tensor | None:
        part, i = self._kv(layer)
        return part.k_center(i, dtype)

    def write(self, layer: int, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        part, i = self._kv(layer)
        part.write(i, cells, k, v)

    def gather_heads(
        self, layer: int, index: torch.Tensor | slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """index: the layer's group's read_index (cell numbers are per pool)."""
        part, i = self._kv(layer)
        return part.gather_heads(i, index)

    def clear(self) -> None:
        for s in self.groups:
            s.clear()
