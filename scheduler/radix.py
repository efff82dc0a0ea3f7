"""The prefix index over held cells: a token-prefix (radix) tree whose nodes point at cells.

Prefix-cache holders (scheduler/prefix_cache.py) keep finished conversations under seq ids,
which running sequences need too. Where the memory can hold cells itself (Memory.holds_cells:
the unified cache), a holder whose seq id is wanted is demoted into this tree instead of being
dropped: its tokens are inserted, the cells of the part the tree did not have yet become held
by the memory (kvcache/held_cells.py), and the seq id is free. So the number of remembered
conversations is bounded by the cells, not by n_seq_max, and one stored prefix (a system
prompt) serves every conversation below it. SGLang's RadixCache is the model.

A node holds the tokens of one edge and their cells (node.start is the first token's
position). A match walks from the root of its LoRA key (K/V computed under one adapter is
never another's) and gives the cells of the longest common prefix; a sequence takes them with
Memory.cells_cp. Under memory pressure the least recently used leaf is evicted first (its
cells are released: freed unless a running sequence shares them); a locked node (a match
being admitted) is never evicted. Nodes are announced to KV events (scheduler/kv_blocks.py)
under key -uid, each with its whole path, so a block is stored while any node covers it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from kvcache.memory import Memory
from scheduler.kv_blocks import BlockLedger
from scheduler.plan import LoraKey
from scheduler.prefix_cache import common_prefix_len, uses_adapter

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(slots=True, eq=False)
class Node:
    uid: int
    start: int  # position of tokens[0]
    tokens: np.ndarray  # [n] int64
    cells: np.ndarray  # [n] int64: the held cell of each token
    parent: Node | None
    lora: LoraKey = ()
    lora_name: str | None = None
    children: dict[int, Node] = field(default_factory=dict)
    last_used: int = 0
    lock: int = 0
    alive: bool = True

    @property
    def end(self) -> int:
        return self.start + int(self.tokens.shape[0])


@dataclass(slots=True)
class RadixMatch:
    length: int
    cells: np.ndarray  # [length] int64: the cells of positions 0..length-1
    node: Node | None  # the deepest node the match reaches (for touch and lock)


class RadixCache:
    def __init__(self, memory: Memory) -> None:
        self.memory = memory
        self.ledger: BlockLedger | None = None  # virtual blocks for KV events, when enabled
        self._roots: dict[LoraKey, Node] = {}
        self._heap: list[tuple[int, int, Node]] = []  # (last_used, uid, leaf), lazily stale
        self._clock = 0
        self._uid = 0
        self.num_nodes = 0
        self.num_cells = 0

    def match(self, tokens: np.ndarray, lora: LoraKey = ()) -> RadixMatch:
        """The longest prefix of `tokens` in the tree of `lora`; never mutates."""
        node = self._roots.get(lora)
        parts: list[np.ndarray] = []
        i, n = 0, int(tokens.shape[0])
        last = None
        while node is not None and i < n:
            child = node.children.get(int(tokens[i]))
            if child is None:
                break
            k = common_prefix_len(child.tokens, tokens[i:])
            parts.append(child.cells[:k])
            i += k
            last = child
            node = child if k == child.tokens.shape[0] else None
        return RadixMatch(i, np.concatenate(parts) if parts else _EMPTY, last)

    def insert(
        self,
        tokens: np.ndarray,
        cells: np.ndarray,
        lora: LoraKey = (),
        lora_name: str | None = None,
    ) -> int:
        """Index `tokens` whose cells (positions 0..n-1) are `cells`; the memory holds those
        of the part the tree did not have (the rest are the caller's to free). -> how many."""
        assert tokens.shape == cells.shape
        node = self._roots.get(lora)
        if node is None:
            node = self._roots[lora] = Node(0, 0, _EMPTY, _EMPTY, None, lora, lora_name)
        i, n, added = 0, int(tokens.shape[0]), 0
        while i < n:
            child = node.children.get(int(tokens[i]))
            if child is None:
                child = self._new(node, i, tokens[i:].copy(), cells[i:].copy())
                self.memory.cells_hold(child.cells)
                self.num_cells += n - i
                self._announce(child, tokens[:n])
                added = n - i
                node, i = child, n
                break
            k = common_prefix_len(child.tokens, tokens[i:])
            if k < child.tokens.shape[0]:
                child = self._split(child, k, tokens)
            node, i = child, i + k
        self.touch(node)
        return added

    def touch(self, node: Node | None) -> None:
        """`node` and its ancestors were used now."""
        if node is None:
            return
        self._clock += 1
        if not node.children:
            heapq.heappush(self._heap, (self._clock, node.uid, node))
            self._compact()
        walk: Node | None = node
        while walk is not None:
            walk.last_used = self._clock
            walk = walk.parent

    def lock(self, node: Node | None, delta: int = 1) -> None:
        """A locked node and its ancestors are never evicted (delta -1 unlocks)."""
        while node is not None:
            node.lock += delta
            assert node.lock >= 0
            node = node.parent

    def evict_lru(self) -> bool:
        """Evict the least recently used unlocked leaf; False when there is none."""
        skipped: list[tuple[int, int, Node]] = []
        found = False
        while self._heap:
            entry = heapq.heappop(self._heap)
            t, _, leaf = entry
            if not leaf.alive or leaf.children or leaf.last_used != t or leaf.parent is None:
                continue
            if leaf.lock:
                skipped.append(entry)
                continue
            self._remove(leaf)
            found = True
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found

    def clear(self) -> None:
        """Release every held cell."""
        while self._roots:
            _, root = self._roots.popitem()
            self._drop_tree(root)
        self._heap = []

    def drop_adapter(self, adapter_id: int) -> None:
        """Release the trees computed under adapter `adapter_id`, alone or in a mix (their
        leaves' heap entries go stale). Nothing in them may be locked: call between steps."""
        for key in [k for k in self._roots if uses_adapter(k, adapter_id)]:
            self._drop_tree(self._roots.pop(key))

    def nodes(self) -> list[Node]:
        """Every node but the roots, parents before children."""
        out: list[Node] = []
        stack = [r for r in self._roots.values()]
        while stack:
            node = stack.pop()
            if node.parent is not None:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def path_tokens(self, node: Node) -> np.ndarray:
        parts: list[np.ndarray] = []
        walk: Node | None = node
        while walk is not None:
            parts.append(walk.tokens)
            walk = walk.parent
        return np.concatenate(parts[::-1])

    def announce(self, ledger: BlockLedger) -> None:
        """Start KV events: every node's blocks go into `ledger`."""
        self.ledger = ledger
        for node in self.nodes():
            ledger.add(-node.uid, self.path_tokens(node), node.lora, node.lora_name)

    def held(self) -> np.ndarray:
        """Every cell the tree points at (for checks)."""
        cells = [n.cells for n in self.nodes()]
        return np.concatenate(cells) if cells else _EMPTY

    # -- internals -----------------------------------------------------------------------------

    def _new(self, parent: Node, start: int, tokens: np.ndarray, cells: np.ndarray) -> Node:
        self._uid += 1
        node = Node(self._uid, start, tokens, cells, parent, parent.lora, parent.lora_name)
        parent.children[int(tokens[0])] = node
        self.num_nodes += 1
        return node

    def _split(self, child: Node, k: int, tokens: np.ndarray) -> Node:
        """Cut `child` after its first k tokens; -> the new upper node."""
        assert child.parent is not None and 0 < k < child.tokens.shape[0]
        upper = self._new(child.parent, child.start, child.tokens[:k], child.cells[:k])
        upper.last_used, upper.lock = child.last_used, child.lock
        child.tokens, child.cells = child.tokens[k:], child.cells[k:]
        child.start += k
        child.parent = upper
        upper.children[int(child.tokens[0])] = child
        self._announce(upper, tokens)
        return upper

    def _drop_tree(self, root: Node) -> None:
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            assert not node.lock, "a locked node is being admitted"
            stack.extend(node.children.values())
            self.memory.cells_release(node.cells)
            node.alive = False
            self.num_nodes -= 1
            self.num_cells -= int(node.tokens.shape[0])
            if self.ledger is not None:
                self.ledger.remove(-node.uid)

    def _remove(self, leaf: Node) -> None:
        parent = leaf.parent
        assert parent is not None and not leaf.children and not leaf.lock
        self.memory.cells_release(leaf.cells)
        del parent.children[int(leaf.tokens[0])]
        leaf.alive = False
        self.num_nodes -= 1
        self.num_cells -= int(leaf.tokens.shape[0])
        if self.ledger is not None:
            self.ledger.remove(-leaf.uid)
        if parent.parent is not None and not parent.children:
            heapq.heappush(self._heap, (parent.last_used, parent.uid, parent))

    def _compact(self) -> None:
        """Drop the stale heap entries once they outnumber the live ones."""
        if len(self._heap) > 2 * self.num_nodes + 64:
            self._heap = [(n.last_used, n.uid, n) for n in self.nodes() if not n.children]
            heapq.heapify(self._heap)

    def _announce(self, node: Node, tokens: np.ndarray) -> None:
        """`tokens` starts with node's path."""
        if self.ledger is not None:
            self.ledger.add(-node.uid, tokens[: node.end], node.lora, node.lora_name)
