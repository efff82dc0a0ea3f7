"""Prefix sharing with running sequences: where a new sequence's prefix comes from, and when it
waits for one that another sequence is computing right now.

Only what was computed under the same LoRA adapters is shared (Request.lora).

A new sequence starts from the longest usable computed prefix (Memory.usable_prefix) of
a prefix-cache holder (PrefixCache), the prefix index over held cells (RadixCache) or a
running sequence: tokens[:num_computed] of
any running choice (only up to n_keep once it has shifted, as for a holder), taken by seq_cp
(vLLM and SGLang share every computed block of running requests the same way).

Waiting: where a running sequence is still reading a prompt that shares with the new one at
least `prefix_wait_min` tokens, and more than anything computed, the new one stays in the queue
(it is not admitted: it owns no seq id and no cell) and takes the prefix by seq_cp once it is
computed: chunked prefill makes that a matter of steps. Every step decides this again from
the live state, so a reader that is aborted (its computed part becomes a holder) or
preempted (it requeues in front, and is read after again) leaves nothing dangling: the
waiter simply matches what exists then.

NOTE: a memory that keeps every prefix of a growing sequence usable (Memory.keeps_prefixes:
the unified cache) serves the shared length at any later step. A sliding-window pool prunes
the cells behind the window, and a recurrent state moves on (only checkpoints stay), so for
those the reader's prompt chunks stop exactly at each waiter's shared length (`next_stop`):
one step later the reader's window, or its tail state, is exactly the waiter's prefix.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import numpy as np

from kvcache.memory import Memory
from scheduler.config import EngineConfig
from scheduler.context_shift import clamp_n_keep
from scheduler.plan import LoraKey
from scheduler.prefix_cache import PrefixCache, PrefixMatch, common_prefix_len
from scheduler.radix import RadixCache
from scheduler.sequence import SeqState, Sequence


def query_tokens(seq: Sequence) -> np.ndarray:
    """What a sequence may take from a cache: all of its context but the last token (one row
    must be computed to sample from)."""
    return np.asarray(seq.tokens[: seq.num_tokens - 1], dtype=np.int64)


def is_reading(seq: Sequence) -> bool:
    """A running sequence with prompt (or recomputed) tokens still to compute, whose cells
    outlive its prompt (an embedding request's leave with it: nobody waits for them)."""
    running = seq.state is SeqState.RUNNING and seq.seq_id >= 0
    return running and not seq.is_decoding and not seq.request.embed


class Sharing:
    def __init__(
        self,
        prefix: PrefixCache,
        memory: Memory,
        config: EngineConfig,
        radix: RadixCache | None = None,
    ) -> None:
        self.prefix = prefix
        self.memory = memory
        self.config = config
        self.radix = radix

    def cached(self, tokens: np.ndarray, lora: LoraKey = ()) -> PrefixMatch:
        """The longest usable prefix of `tokens` that the prefix cache keeps (a holder, or
        the prefix index where it is longer); never mutates."""
        best = self.prefix.match(tokens, self.memory.usable_prefix, lora)
        if self.radix is not None:
            r = self.radix.match(tokens, lora)
            if r.length > best.length:
                best = PrefixMatch(-1, r.length, radix=r)
        return best

    def num_reusable(self, seq: Sequence) -> int:
        """How many of a running sequence's tokens it holds at positions 0..n-1 with their
        cold values: all it computed, or only the kept head once it has shifted."""
        n = seq.num_computed
        if seq.num_shifts:
            keep = clamp_n_keep(seq.request.n_keep, seq.num_prompt, self.config.n_ctx_seq)
            n = min(n, keep)
        return n

    def computed(self, seq: Sequence) -> np.ndarray:
        return np.asarray(seq.tokens[: self.num_reusable(seq)], dtype=np.int64)

    def announce(self, running: Iterable[Sequence]) -> None:
        """KV events (scheduler/kv_blocks.py): what each running sequence could share now
        (`match` takes it) is held in the ledger, as vLLM announces a block once computed.
        Only where it is shareable: with prefix caching, on a memory that keeps every prefix
        of a growing sequence (a window or a recurrent state moves on)."""
        ledger = self.prefix.ledger
        if ledger is None:
            return
        held: dict[Hashable, tuple[list[int], int, LoraKey, str | None]] = {}
        if self.config.prefix_cache and self.memory.keeps_prefixes:
            for s in running:
                # NOTE: an embedding request's cells leave with it in the step that read them
                if s.state is SeqState.RUNNING and s.seq_id >= 0 and not s.request.embed:
                    req = s.request
                    held[s] = (s.tokens, self.num_reusable(s), req.lora, req.lora_name)
        ledger.hold_running(held)

    def match(self, seq: Sequence, running: Iterable[Sequence]) -> PrefixMatch:
        """The longest usable computed prefix of `seq` among holders and running sequences;
        never mutates."""
        tokens = query_tokens(seq)
        lora = seq.request.lora
        best = self.cached(tokens, lora)
        for s in running:
            if s.state is not SeqState.RUNNING or s.seq_id < 0 or s.request.lora != lora:
                continue
            n = common_prefix_len(self.computed(s), tokens)
            if n > best.length:
                n = self.memory.usable_prefix(s.seq_id, n)
            if n > best.length:
                best = PrefixMatch(s.seq_id, n, holder=False)
        return best

    def pending(self, seq: Sequence, running: Iterable[Sequence]) -> int:
        """The longest prefix of `seq` that a running reader has not computed yet but will."""
        tokens = query_tokens(seq)
        best = 0
        for s in running:
            if is_reading(s) and s.request.lora == seq.request.lora:
                n = common_prefix_len(np.asarray(s.tokens, dtype=np.int64), tokens)
                if n > s.num_computed:
                    best = max(best, n)
        return best

    def waits(self, seq: Sequence, running: Iterable[Sequence], match: PrefixMatch) -> bool:
        """Whether `seq` should stay queued for a prefix being computed now (module doc)."""
        if not self.config.prefix_cache:
            return False
        n = self.pending(seq, running)
        return n > match.length and n >= self.config.prefix_wait_min

    def next_stop(self, reader: Sequence, waiting: Iterable[Sequence]) -> int:
        """Where `reader`'s next prompt chunk must end so that the queued sequences sharing a
        prefix with it can take it (module NOTE); a large number when nothing stops it."""
        stop = 1 << 62
        if not self.config.prefix_cache or self.memory.keeps_prefixes or not is_reading(reader):
            return stop
        tokens = np.asarray(reader.tokens, dtype=np.int64)
        for w in waiting:
            if w.request.lora != reader.request.lora:
                continue
            n = common_prefix_len(tokens, query_tokens(w))
            if n > reader.num_computed and n >= self.config.prefix_wait_min:
                stop = min(stop, n)
        return stop
