"""A reduced output head: a draft model's vocabulary cut to its frequent ids (--draft-vocab).

FR-Spec's and EAGLE-3's observation: a draft's proposals need only part of the vocabulary,
and its output head is a large part of a small model's forward (Qwen2.5-0.5B: 151,936 rows, a
fifth of each step). BPE and SentencePiece vocabularies number frequent tokens first, so the
first n rows keep most of what a draft proposes; the ids of the sequences themselves (what an
edit or a quote copies) are scored on demand from the whole head's weight, as loaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.layers.blocks import Linear
from model.layers.ggml import BlockLinear, BlockWeight


class ReducedHead(nn.Module):
    """An output head that scores token ids 0..n-1 (`rows`: the head's first n rows, a Linear
    that quantize() may quantize like the head, or a BlockLinear) and, on demand, other ids from
    the whole head's weight (kept as it was: a view of the file or the dense tensor)."""

    is_head = True  # model/layers/quant.py: quantized as the head

    def __init__(self, head: nn.Module, n: int) -> None:
        super().__init__()
        self.n = n
        self.bias: torch.Tensor | None = None
        self.full: torch.Tensor | BlockWeight
        if isinstance(head, BlockLinear):
            self.rows: nn.Module = head.first_rows(n)
            self.full, self.kernels = head.weights[0], head.kernels
            self.bias = head.bias
        elif isinstance(head, Linear):
            bias = None if head.bias is None else head.bias.detach()
            self.rows = Linear(head.weight[:n], None if bias is None else bias[:n])
            self.full, self.bias = head.weight.detach(), bias
        else:
            raise ValueError(f"the output head is a {type(head).__name__}: cannot keep rows of it")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [n, self.n] of ids 0..n-1 in the head's dtype."""
        return self.rows(hidden)

    def scored(
        self, hidden: torch.Tensor, head_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (float32 logits [rows, n + m]: ids 0..n-1, then the m distinct ids of `head_ids`
        at or above n, those ids [m])."""
        out = self.rows(hidden).float()
        full = self.full
        if head_ids is None:
            return out, torch.zeros(0, dtype=torch.int64, device=out.device)
        ids = torch.unique(head_ids.to(device=out.device, dtype=torch.int64))
        ids = ids[(ids >= self.n) & (ids < full.shape[0])]
        if ids.numel() == 0:
            return out, ids
        if isinstance(full, BlockWeight):  # the file's rows of those ids, in the file's layout
            rows, k = full.data.index_select(0, ids), full.shape[1]
            extra = self.kernels.ggml_linear(hidden.contiguous(), [rows], [full.ggml_type], k)
        else:
            extra = F.linear(hidden, full.index_select(0, ids).to(hidden.dtype))
        if self.bias is not None:
            extra = extra + self.bias[ids].to(extra.dtype)
        return torch.cat([out, extra.float()], dim=1), ids

    def spread(self, out: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
        """scored's logits [rows, n + m] (scaled and capped as the model does) -> [rows, vocab]
        with -inf at every id not scored."""
        full = out.new_full((out.shape[0], vocab), float("-inf"))
        full[:, : self.n] = out[:, : self.n]
        full[:, ids] = out[:, self.n :]
        return full
