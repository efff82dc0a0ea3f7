"""What the scheduler hands the worker each step, and what it gets back.

Plain dataclasses and numpy arrays only: no tensors cross this boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvcache.cells import PendingOps

if TYPE_CHECKING:
    from scheduler.constraint import Constraint


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI / vLLM semantics)."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/vLLM style: over prompt + output tokens
    presence_penalty: float = 0.0  # OpenAI style: over output tokens
    frequency_penalty: float = 0.0  # OpenAI style: over output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0  # 0..20

    @property
    def needs_history(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass(slots=True)
class SeqBatch:
    """One sequence's share of a batch: rows [start, end) of the flat token arrays are its
    new tokens (contiguous, ascending positions); kv_cells/kv_pos are ALL the cells it owns
    after this step's tokens are placed, sorted by position (what attention gathers)."""

    seq_id: int
    start: int
    end: int
    kv_cells: np.ndarray  # [n_kv] int64
    kv_pos: np.ndarray  # [n_kv] int64


@dataclass(slots=True)
class SampleRow:
    """A row of the batch whose logits are sampled into the next token of a sequence.

    NOTE: the random stream of a sampled token is a pure function of (seed, output_index),
    so a seeded request gives the same text whatever else shares its batch, and a preempted
    request resumes with the same draws.
    """

    row: int  # index into the flat token arrays
    params: SamplingParams
    seed: int
    output_index: int  # 0 for the first generated token of this choice
    num_prompt: int  # len of the prompt part of `history`
    history: list[int] | None = None  # prompt + generated ids; only when params.needs_history
    suppress_ids: tuple[int, ...] = ()  # ids that must not be sampled (EOS before min_tokens)
    embed: bool = False  # return this row's hidden state (StepOutput.embeddings), sample nothing
    # structured output: only the tokens this matcher allows may be sampled (the worker reads
    # its bitmask; the scheduler advances it in update())
    constraint: Constraint | None = None


@dataclass(slots=True)
class BatchPlan:
    """One step of work. Tokens of one sequence are contiguous and in position order."""

    token_ids: np.ndarray  # [n_tokens] int64
    positions: np.ndarray  # [n_tokens] int64
    seq_ids: np.ndarray  # [n_tokens] int64
    cells: np.ndarray  # [n_tokens] int64: where each token's K/V is written
    seqs: list[SeqBatch]
    samples: list[SampleRow]
    pending: PendingOps  # cell copies and K-shifts to apply BEFORE the forward

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(slots=True)
class StepOutput:
    """One entry per SampleRow of the plan, in the same order (an embed row's token is -1)."""

    token_ids: list[int]
    logprobs: list[float] | None = None  # logprob of each sampled token (raw model distribution)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    embeddings: list[np.ndarray | None] | None = None  # [dim] float32 for each embed row
