"""Token bitmasks of the constrained rows of a step, computed while the forward pass runs."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from llguidance import LLExecutor
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

from scheduler.plan import SampleRow


class MaskFiller:
    """`start(rows)` hands the rows' matchers to a helper thread (llguidance computes the masks
    without the GIL, in parallel over rows) and returns at once; `None` when no row is
    constrained, so unconstrained steps pay nothing.

    NOTE: the matchers must not advance until the future is done: the engine advances them in
    Scheduler.update(), after execute() returned, which waits for it.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._thread: ThreadPoolExecutor | None = None
        self._executor: LLExecutor | None = None

    def start(self, rows: list[SampleRow]) -> Future[np.ndarray] | None:
        """-> a future of the bitmask [len(rows), ceil(vocab / 32)] int32 (bit t of row i set
        = token t allowed; every bit set on an unconstrained row)."""
        todo = [(r.constraint.matcher, i) for i, r in enumerate(rows) if r.constraint is not None]
        if not todo:
            return None
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="cellserve-mask")
            self._executor = LLExecutor()
        executor = self._executor
        assert executor is not None
        bitmask = allocate_token_bitmask(len(rows), self.vocab_size)

        def fill() -> np.ndarray:
            fill_next_token_bitmask_par(executor, todo, bitmask)
            return bitmask

        return self._thread.submit(fill)


def allowed_tokens(bitmask_row: np.ndarray, vocab: int) -> torch.Tensor:
    """[ceil(vocab / 32)] int32 bitmask -> [vocab] bool."""
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab]
    return torch.from_numpy(bits.astype(bool))


def apply_mask(logits: torch.Tensor, bitmask_row: np.ndarray) -> torch.Tensor:
    """[vocab] logits with the disallowed tokens at -inf (new tensor). A mask that allows
    nothing (a matcher in its error state) is not applied: the scheduler reports the error
    when the sampled token is rejected."""
    allowed = allowed_tokens(bitmask_row, logits.shape[0])
    if not bool(allowed.any()):
        return logits.clone()
    return logits.masked_fill(~allowed, float("-inf"))
