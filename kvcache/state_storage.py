"""RecurrentStorage: the per-sequence states behind a recurrent memory's slots (torch).

A slot holds one sequence's whole state in every recurrent layer (llama.cpp's
`llama_memory_recurrent` cell: r = conv rows, s = ssm rows). There is nothing per token:
a sequence reads its slot's state before its first row of a step and leaves the state after
its last row there (scheduler.plan.GroupBatch of the "recurrent" group).
"""

from __future__ import annotations

import torch

from kvcache.cell_file import rows_geometry
from kvcache.cells import PendingOps
from kvcache.zeros import lazy_zeros


class RecurrentStorage:
    """Per recurrent layer (`layers`, the model's layer indices): conv [n_slots, *conv_shape]
    in `dtype` and ssm [n_slots, *ssm_shape] float32 (the state accumulates over thousands of
    steps: SGLang's default state dtype, llama.cpp's F32 s rows).

    Mamba2: conv_shape (conv_dim, d_conv - 1), oldest column first (F.conv1d's time axis);
    ssm_shape (n_heads, head_dim, d_state)."""

    def __init__(
        self,
        layers: tuple[int, ...],
        n_slots: int,
        conv_shape: tuple[int, ...],
        ssm_shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.layers = layers
        self.n_slots = n_slots
        self.dtype = dtype
        self.device = torch.device(device)
        self._index = {layer: i for i, layer in enumerate(layers)}
        n = len(layers)
        self._conv = lazy_zeros((n, n_slots, *conv_shape), dtype, self.device)
        self._ssm = lazy_zeros((n, n_slots, *ssm_shape), torch.float32, self.device)
        self._saved = (self._conv.new_empty(0), self._ssm.new_empty(0))  # save()'s buffers

    @property
    def n_cells(self) -> int:
        """The slots (a worker treats a group's pool size uniformly)."""
        return self.n_slots

    @property
    def bytes_per_slot(self) -> int:
        """One sequence's state over every recurrent layer."""
        per_layer = self._conv[0, 0].numel() * self._conv.element_size()
        per_layer += self._ssm[0, 0].numel() * self._ssm.element_size()
        return len(self.layers) * per_layer

    @property
    def num_bytes(self) -> int:
        return self.bytes_per_slot * self.n_slots

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv and ssm states of every slot (what num_bytes counts)."""
        return self._conv, self._ssm

    def conv(self, layer: int) -> torch.Tensor:
        """[n_slots, *conv_shape] of model layer `layer` (a view: writes go to the storage)."""
        return self._conv[self._index[layer]]

    def ssm(self, layer: int) -> torch.Tensor:
        """[n_slots, *ssm_shape] float32 of model layer `layer` (a view)."""
        return self._ssm[self._index[layer]]

    def apply(self, pending: PendingOps) -> None:
        """Whole-state copies `copy_src[i] -> copy_dst[i]` in every layer, in order;
        copy_src -1 zeroes copy_dst (a new sequence starts from the zero state).
        NOTE: a recurrent state has no positions to re-rotate: K-shifts must be absent."""
        assert pending.shift_cells.size == 0, "a recurrent state has nothing to re-rotate"
        src_list, dst_list = pending.copy_src.tolist(), pending.copy_dst.tolist()
        for s, d in zip(src_list, dst_list, strict=True):
            assert 0 <= d < self.n_slots and -1 <= s < self.n_slots, f"bad slot copy {s} -> {d}"
            if s < 0:
                self._conv[:, d].zero_()
                self._ssm[:, d].zero_()
            elif s != d:
                self._conv[:, d] = self._conv[:, s]
                self._ssm[:, d] = self._ssm[:, s]

    def save(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of `slots`' states in every layer, for restore(). The copy lives in a buffer
        kept from step to step (the largest step's size): a fresh allocation of this size per
        step cost more than the copy itself (page faults), and the next save overwrites it."""
        k = int(slots.shape[0])
        conv_n = self._conv[:, 0].numel() * k
        ssm_n = self._ssm[:, 0].numel() * k
        if self._saved[0].numel() < conv_n:
            self._saved = (self._conv.new_empty(conv_n), self._ssm.new_empty(ssm_n))
        n = len(self.layers)
        conv = self._saved[0][:conv_n].view(n, k, *self._conv.shape[2:])
        ssm = self._saved[1][:ssm_n].view(n, k, *self._ssm.shape[2:])
        # NOTE: a copy per slot (each a contiguous run per layer) moves the bytes at ~1.3x (8-32
        # slots) to ~1.9x (one slot) index_select's rate along dim 1 (Mamba2-130M's 18 MB a
        # sequence, 2-core Zen 4: 8 slots 10.4 ms against 13.2)
        for j, slot in enumerate(slots.tolist()):
            conv[:, j].copy_(self._conv[:, slot])
            ssm[:, j].copy_(self._ssm[:, slot])
        return conv, ssm

    def restore(self, slots: torch.Tensor, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Put back the states the last save(slots) copied."""
        self._conv.index_copy_(1, slots, saved[0])
        self._ssm.index_copy_(1, slots, saved[1])

    def read_cells(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of `slots`' [n] states as a slot file keeps rows (kvcache/cell_file.py):
        conv [n_layers, 1, n, conv values] in the storage's dtype and ssm [n_layers, 1, n,
        ssm values] float32; write_cells puts them back."""
        n_layers, k = len(self.layers), int(slots.shape[0])
        conv = self._conv.index_select(1, slots).reshape(n_layers, 1, k, -1)
        ssm = self._ssm.index_select(1, slots).reshape(n_layers, 1, k, -1)
        return conv, ssm

    def write_cells(self, slots: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Put states that read_cells returned (of a storage of the same shapes) into
        `slots` [n]."""
        assert conv.dtype == self._conv.dtype and ssm.dtype == self._ssm.dtype, "another dtype"
        k = int(slots.shape[0])
        slots = slots.to(self.device)
        conv = conv.to(self.device).reshape(len(self.layers), k, *self._conv.shape[2:])
        ssm = ssm.to(self.device).reshape(len(self.layers), k, *self._ssm.shape[2:])
        self._conv.index_copy_(1, slots, conv)
        self._ssm.index_copy_(1, slots, ssm)

    def geometry(self) -> dict[str, object]:
        """What its rows look like as read_cells gives them (a restore checks a file's against
        it): the whole storage as [n_layers, 1, n_slots, values]."""
        n_layers = len(self.layers)
        conv = self._conv.view(n_layers, 1, self.n_slots, -1)
        return rows_geometry(conv, self._ssm.view(n_layers, 1, self.n_slots, -1))

    def clear(self) -> None:
        self._conv.zero_()
        self._ssm.zero_()
