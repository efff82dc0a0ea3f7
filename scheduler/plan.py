"""What the scheduler hands the worker each step, and what it gets back.

Plain dataclasses and numpy arrays only: no tensors cross this boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvcache.cells import PendingOps
from kvcache.memory import Memory, MemoryPlan, SeqCells, seq_cells_view
from kvcache.spec import Recurrent

# LoRA adapters a request runs with: (adapter id, scale) pairs sorted by id, no zero scale;
# () = the base model (model/layers/lora.py)
LoraKey = tuple[tuple[int, float], ...]

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
    new tokens (contiguous, ascending positions)."""

    seq_id: int
    start: int
    end: int
    lora: LoraKey = ()  # the request's LoRA adapters (scheduler.request.Request.lora)


@dataclass(frozen=True, slots=True)
class Capture:
    """A recurrent state checkpoint taken during a step: once sequence `seq` (an index into
    BatchPlan.seqs) has consumed every position < `m`, its state is also copied into `slot`.
    first row's position < m <= last row's position + 1."""

    seq: int
    m: int
    slot: int


@dataclass(slots=True)
class GroupBatch:
    """Where one layer group (MemorySpec.groups, same order) writes and reads this step.
    Groups that share a pool of cells share `cells` and `pending`.

    A recurrent group (key "recurrent": one state slot per sequence, no K/V per token):
    `cells[i]` is the slot of row i's sequence, the same for all its rows: the sequence reads
    its initial state there and leaves its state after its last row there. `seqs` is empty.
    `pending` holds whole-state copies between slots, applied in order BEFORE the forward
    (copy_src[i] == -1: zero slot copy_dst[i], a new sequence); no K-shifts. `captures`,
    sorted by (seq, m), are the checkpoints taken during the forward."""

    key: str  # the group's memory key ("full", "swa4096", "recurrent", ...)
    window: int  # 0: full attention (and recurrent groups)
    cells: np.ndarray  # [n_tokens] int64: where each row's K/V (or its seq's state) goes
    seqs: list[SeqCells]  # aligned with BatchPlan.seqs: what each sequence's rows read
    pending: PendingOps  # cell copies and K-shifts of this group's tensors, BEFORE the forward
    captures: list[Capture] = field(default_factory=list)  # recurrent groups only


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
    seqs: list[SeqBatch]
    groups: list[GroupBatch]  # one per layer group of the model's MemorySpec
    samples: list[SampleRow]
    # token ids a reduced output head scores beside its own rows (a draft model's
    # --draft-vocab: the ids of the drafting sequences); None: the head's rows only
    head_ids: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def has_pending(self) -> bool:
        return any(not g.pending.is_empty for g in self.groups)

    def pending_only(self) -> BatchPlan:
        """A plan with no tokens that applies each group's pending work."""
        empty = np.zeros(0, dtype=np.int64)
        groups = [replace(g, cells=empty, seqs=[], captures=[]) for g in self.groups]
        return BatchPlan(empty, empty, empty, [], groups, [])

    def without_pending(self) -> BatchPlan:
        """This plan's forward, its pending work left out (applied already)."""
        groups = [replace(g, pending=PendingOps.empty()) for g in self.groups]
        return replace(self, groups=groups)


@dataclass(slots=True)
class StepOutput:
    """One entry per SampleRow of the plan, in the same order (an embed row's token is -1)."""

    token_ids: list[int]
    logprobs: list[float] | None = None  # logprob of each sampled token (raw model distribution)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    embeddings: list[np.ndarray | None] | None = None  # [dim] float32 for each embed row


class Worker(Protocol):
    """What the engine drives (model/runner/worker.py; fakes in tests).

    `execute` applies the plan's pending cache work (each group's `pending`) once, before its
    rows read the cache; the engine hands it over in a plan of its own (`pending_only`: no
    tokens, no samples) and runs the forward `without_pending` (scheduler/isolate.py)."""

    def execute(self, plan: BatchPlan) -> StepOutput: ...


def full_group(
    cells: np.ndarray,
    kv: list[tuple[np.ndarray, np.ndarray]],
    q_pos: list[np.ndarray],
    pending: PendingOps | None = None,
    window: int = 0,
) -> GroupBatch:
    """A GroupBatch over one pool: `kv[i]` = (cells, positions) sequence i reads (sorted by
    position), `q_pos[i]` its rows' positions. For workers driven without a Memory."""
    seqs = [seq_cells_view(c, p, q, window) for (c, p), q in zip(kv, q_pos, strict=True)]
    key = "full" if window == 0 else f"swa{window}"
    return GroupBatch(key, window, cells, seqs, PendingOps.empty() if pending is None else pending)


def group_batches(
    memory: Memory, plan: MemoryPlan, views: list[list[SeqCells]], pending: list[PendingOps]
) -> list[GroupBatch]:
    """One GroupBatch per layer group of memory.spec after `plan` is applied: views[i] is
    memory.views() of the step's i-th sequence, pending memory.take_pending(). A recurrent
    group gets the plan's captures, sorted by (seq, m) with seq an index into the step's
    sequences (in row order)."""
    out = []
    for g, (group, pool) in enumerate(zip(memory.spec.groups, memory.group_pools, strict=True)):
        if isinstance(group.spec, Recurrent):
            index = {s: i for i, s in enumerate(dict.fromkeys(plan.seq_ids.tolist()))}
            order = sorted((index[s], m, slot) for s, m, slot in plan.captures)
            captures = [Capture(i, m, slot) for i, m, slot in order]
            out.append(GroupBatch(group.key, 0, plan.cells[pool], [], pending[g], captures))
            continue
        window = getattr(group.spec, "window", 0)
        seqs = [v[g] for v in views]
        out.append(GroupBatch(group.key, window, plan.cells[pool], seqs, pending[g]))
    return out
