"""Virtual KV blocks over the prefix cache, for routers that track blocks (vLLM's KV events).

cellserve's cache has cells, not blocks. What a router can reuse is a prefix-cache holder's
tokens (positions 0..n-1), so every `block_size` consecutive positions of a holder, from
position 0, are one virtual block; a trailing partial block is not announced (vLLM announces
only full blocks too). A block's hash chains its parent's: the same prefix gives the same
hashes on every replica. Holders share blocks (a shared system prompt): a block is stored
when its first holder appears and removed when its last holder goes, so at any time
stored - removed = the blocks of the holders. Plain Python, called under the engine's lock.

Running sequences are holders too (vLLM announces a block once it is computed, since another
request can reuse it then; cellserve shares running sequences' computed cells,
scheduler/sharing.py): each step the scheduler says what every running sequence holds now
(`hold_running`), its blocks are added or cut, and a sequence that left releases its own. So a
request's blocks are stored while it runs and pass to the holder its finish makes without a
second BlockStored; they are removed only when neither a running sequence nor the cache keeps
them.

A holder computed under LoRA adapters (scheduler.plan.LoraKey) chains from a root hashed from
them (vLLM puts the LoRA in its block hash's extra keys): its blocks never equal the base
model's, and its BlockStored events carry `lora_id` (the adapter's id + 1 for one adapter,
vLLM's lora_int_id counting from 1) and `lora_name`.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from scheduler.plan import LoraKey

ROOT_HASH = 0


def block_hash(parent: int, tokens: np.ndarray) -> int:
    """Unsigned 64 bits of sha256(parent as 8 bytes big-endian || tokens as int64 LE)."""
    h = hashlib.sha256(parent.to_bytes(8, "big"))
    h.update(np.ascontiguousarray(tokens, dtype="<i8").tobytes())
    return int.from_bytes(h.digest()[:8], "big")


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]  # one chain, parent first
    parent_block_hash: int | None  # None: the first block of a prompt
    token_ids: list[int]  # block_size tokens per block, concatenated
    lora_id: int | None = None  # None: the base model
    lora_name: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def lora_root(lora: LoraKey) -> int:
    """The hash a chain computed under `lora` starts from (ROOT_HASH for the base model)."""
    if not lora:
        return ROOT_HASH
    key = ";".join(f"{aid}:{scale!r}" for aid, scale in lora).encode()
    return int.from_bytes(hashlib.sha256(b"lora|" + key).digest()[:8], "big")


def lora_int_id(lora: LoraKey) -> int | None:
    """The lora_id of KV events: None for the base model, adapter id + 1 for one adapter at
    scale 1, else 31 bits of lora_root (a mix or another scale is its own cache)."""
    if not lora:
        return None
    if len(lora) == 1 and lora[0][1] == 1.0:
        return lora[0][0] + 1
    return lora_root(lora) >> 33


class BlockLedger:
    """Holders by key: prefix-cache holders by seq id, prefix-index nodes by -uid, running
    sequences by their scheduler.sequence.Sequence."""

    def __init__(self, block_size: int) -> None:
        assert block_size >= 1
        self.block_size = block_size
        self._holder_blocks: dict[Hashable, list[int]] = {}
        self._running: set[Hashable] = set()
        self._refs: Counter[int] = Counter()  # block hash -> holders that hold it
        self._events: list[KVEvent] = []

    @property
    def blocks(self) -> set[int]:
        return set(self._refs)

    def chain(
        self, tokens: Sequence[int] | np.ndarray, lora: LoraKey = (), parent: int | None = None
    ) -> list[tuple[int, int | None, Sequence[int] | np.ndarray]]:
        """(hash, parent hash, tokens) of each full block of `tokens` computed under `lora`;
        `parent`: the hash of the block before tokens[0] (None: tokens[0] is position 0)."""
        out: list[tuple[int, int | None, Sequence[int] | np.ndarray]] = []
        root = lora_root(lora)
        bs = self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            chunk = tokens[start : start + bs]
            h = block_hash(root if parent is None else parent, np.asarray(chunk))
            out.append((h, parent, chunk))
            parent = h
        return out

    def add(
        self, key: Hashable, tokens: np.ndarray, lora: LoraKey = (), lora_name: str | None = None
    ) -> None:
        """`key` became a holder of `tokens` (under `lora`): its blocks that no holder had
        are stored."""
        assert key not in self._holder_blocks
        self.hold(key, tokens, len(tokens), lora, lora_name)

    def hold(
        self,
        key: Hashable,
        tokens: Sequence[int] | np.ndarray,
        n: int,
        lora: LoraKey = (),
        lora_name: str | None = None,
    ) -> None:
        """`key` holds tokens[:n] at positions 0..n-1 now: the blocks it gains that no holder
        had are stored, the blocks past n it held that no other holder keeps are removed.
        NOTE: for a key already held, tokens[:n] must start with the blocks it held up to
        min(n, what it held): a running sequence's computed prefix only grows, or loses its
        tail (context shift, preemption); only the new blocks are hashed."""
        hashes = self._holder_blocks.setdefault(key, [])
        bs = self.block_size
        n_full = n // bs
        if n_full < len(hashes):
            self._release(hashes[n_full:])
            del hashes[n_full:]
        parent = hashes[-1] if hashes else None
        run: BlockStored | None = None
        for h, up, chunk in self.chain(tokens[len(hashes) * bs : n_full * bs], lora, parent):
            hashes.append(h)
            self._refs[h] += 1
            if self._refs[h] > 1:
                run = None
                continue
            if run is None:  # consecutive new blocks go out as one chain
                run = BlockStored([], up, [], lora_int_id(lora), lora_name)
                self._events.append(run)
            run.block_hashes.append(h)
            run.token_ids.extend(int(t) for t in chunk)

    def hold_running(
        self, held: Mapping[Hashable, tuple[Sequence[int], int, LoraKey, str | None]]
    ) -> None:
        """The running sequences hold exactly these now, key -> (tokens, n, lora, lora_name)
        as for `hold`; a running key not in `held` left and releases its blocks. Holds go
        first: a block that passes between running keys is never removed and stored again."""
        for key, (tokens, n, lora, lora_name) in held.items():
            self.hold(key, tokens, n, lora, lora_name)
        for key in self._running - held.keys():
            self.remove(key)
        self._running = set(held)

    def remove(self, key: Hashable) -> None:
        """`key` is no longer a holder: the blocks no other holder keeps are removed."""
        self._release(self._holder_blocks.pop(key, []))

    def _release(self, hashes: list[int]) -> None:
        gone = []
        for h in hashes:
            self._refs[h] -= 1
            if self._refs[h] == 0:
                del self._refs[h]
                gone.append(h)
        if gone:
            self._events.append(BlockRemoved(gone))

    def cleared(self) -> None:
        """Every cache holder was dropped (a cache reset): where no running sequence holds a
        block either, one AllBlocksCleared replaces the events not taken yet (nothing is held
        after it); else the removals say exactly what went."""
        assert self._holder_blocks.keys() <= self._running
        if not self._refs:
            self._events = [AllBlocksCleared()]

    def take(self) -> list[KVEvent]:
        """The events since the last take, in order."""
        events, self._events = self._events, []
        return events
