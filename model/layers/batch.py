"""What one forward reads besides the weights: the batch's rows and each layer's attention groups.

A batch is flat: row i is one token at `positions[i]` whose K/V goes into cell `cells[i]`;
attention groups say which cells each row may read. Layers with a sliding window read through
their own groups (`ForwardBatch.windowed`), built from the same plan with the window's mask.
Recurrent layers read `ForwardBatch.state`: each sequence's state slot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from model.kernels import DecodeAttention, PromptAttention


@dataclass(slots=True)
class DecodeGroup:
    """Rows with one new token each, attended together over padded kv."""

    rows: torch.Tensor | None  # [n_seq] int64; None: every row of the batch, in order
    kv_index: torch.Tensor | slice  # KVStorage.read_index of [n_seq * max_kv] cells (pad: any)
    bias: torch.Tensor | None  # [n_seq, 1, max_kv] model dtype: 0 visible, -inf not; None: all
    max_kv: int
    # for the C++ kernels, set together when each seq sees exactly cells[i, :lens[i]]:
    cells: torch.Tensor | None = None  # [n_seq, max_kv] int64
    lens: torch.Tensor | None = None  # [n_seq] int64


@dataclass(slots=True)
class PromptGroup:
    """Contiguous rows [start, end) of one sequence (a prompt chunk)."""

    start: int
    end: int
    kv_index: torch.Tensor | slice  # KVStorage.read_index of the [n_kv] cells it reads
    mask: torch.Tensor  # [end - start, n_kv] bool
    # for the C++ prompt kernel: the cells in position order, how many of them each row sees,
    # and (a sliding window that cuts some of them) the first of them each row sees
    cells: torch.Tensor | None = None  # [n_kv] int64
    lens: torch.Tensor | None = None  # [end - start] int64
    firsts: torch.Tensor | None = None  # [end - start] int64; None: 0 for every row


@dataclass(slots=True)
class AttnGroups:
    """The attention groups of the layers with one window."""

    decodes: list[DecodeGroup]
    prompts: list[PromptGroup]
    # [n] int64: where these layers write each row when their pool is their own (iSWA's
    # window pool); None: ForwardBatch.cells
    cells: torch.Tensor | None = None


@dataclass(slots=True)
class StatePrompt:
    """Contiguous rows [start, end) of one sequence run through a recurrent mixer as a scan
    from `slot`'s state (a prompt chunk, or any row whose state is also captured)."""

    start: int
    end: int
    slot: int
    # (r, slot): once the first r rows are consumed (0 < r <= end - start), copy the state
    # into `slot` too (scheduler.plan.Capture, relative to the chunk), ascending r
    captures: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class StateBatch:
    """What the recurrent layers read: one-step updates of the decode rows, batched over their
    slots, and a scan per prompt chunk. Rows in neither (batch-invariant padding) get 0."""

    decode_rows: torch.Tensor | None  # [n_dec] int64; None: every row of the batch, in order
    decode_slots: torch.Tensor  # [n_dec] int64, distinct
    prompts: list[StatePrompt]
    # decode_slots as a range [lo, hi) when they are one (the states are then updated in
    # place instead of gathered and scattered back)
    decode_run: tuple[int, int] | None = None
    # the same as the kernels' StepState, built once a batch (native_state)
    native: Any | None = None

    def native_state(self, kernels: Any) -> Any:
        """This batch as `kernels`' StepState (short_conv, mamba2_mix, step_layers)."""
        if self.native is None:
            st = kernels.StepState()
            st.decode_rows = _EVERY_ROW if self.decode_rows is None else self.decode_rows
            st.decode_slots = self.decode_slots
            st.prompt_bounds = [b for p in self.prompts for b in (p.start, p.end)]
            st.prompt_slots = [p.slot for p in self.prompts]
            st.captures = [
                v for i, p in enumerate(self.prompts) for r, s in p.captures for v in (i, r, s)
            ]
            if self.decode_run is not None:
                st.decode_run_lo, st.decode_run_hi = self.decode_run
            self.native = st
        return self.native

    def run(
        self,
        out: torch.Tensor,
        inputs: tuple[torch.Tensor, ...],
        step: Callable[..., torch.Tensor],
        scan: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        """A recurrent mixer's torch path over this batch: the decode rows of `inputs` (each
        [n, ...]) through `step(*rows)` at once, each prompt chunk through `scan(*rows, p)`,
        into `out` [n, ...] (rows in neither keep out's values); returns out, or step's
        output where the decode rows are every row."""
        if self.decode_slots.numel():
            if self.decode_rows is None:
                out = step(*inputs)
            else:
                out.index_copy_(0, self.decode_rows, step(*(t[self.decode_rows] for t in inputs)))
        for p in self.prompts:
            out[p.start : p.end] = scan(*(t[p.start : p.end] for t in inputs), p)
        return out


_EVERY_ROW = torch.empty(0, dtype=torch.int64)  # StepState: the decode rows are every row


@dataclass(slots=True)
class ForwardBatch:
    tokens: torch.Tensor  # [n] int64
    cells: torch.Tensor  # [n] int64
    rope_c: torch.Tensor  # [n, 1, head_dim] model dtype (kvcache.rope.rope_tables)
    rope_s: torch.Tensor  # [n, 1, head_dim]
    decodes: list[DecodeGroup]  # full-attention layers
    prompts: list[PromptGroup]
    logit_rows: torch.Tensor  # [n_out] int64
    decode_kernel: DecodeAttention | None = None  # model.kernels.load_decode_attention()
    prompt_kernel: PromptAttention | None = None  # kernels.prompt_attention (bfloat16 only)
    fused: Any | None = None  # the kernels module: its fused RMSNorm, SiLU-mul, RoPE (rms_norm)
    # sliding-window layers: their RoPE tables (ModelArgs.rope_swa) and groups by window
    rope_swa: tuple[torch.Tensor, torch.Tensor] | None = None  # ([n, 1, hd], [n, 1, hd])
    windowed: dict[int, AttnGroups] = field(default_factory=dict)
    state: StateBatch | None = None  # models with recurrent layers
    # rows with LoRA adapters (model/layers/lora.py LoraBatch); None: base-model rows only
    lora: list[Any] | None = None

    def write_cells(self, window: int) -> torch.Tensor:
        """[n] int64: the cells the layers with `window` write the batch's rows to."""
        g = self.windowed.get(window) if window else None
        return self.cells if g is None or g.cells is None else g.cells

    def groups(self, window: int) -> tuple[list[DecodeGroup], list[PromptGroup]]:
        if window == 0:
            return self.decodes, self.prompts
        g = self.windowed[window]
        return g.decodes, g.prompts
