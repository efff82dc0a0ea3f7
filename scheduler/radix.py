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

On a memory with sliding-window pools (iSWA: Memory.index_windows), a sequence given [0, m)
also needs the window cells of [m - W + 1, m) in each, or its next row would read a window the
cold run never skipped (docs/prefix_index_swa.md). So the node where a demoted holder ends keeps
its window too (Node.window: the SWA cells of its last W positions, what pruning left), and a
match is usable only at a length such a window covers: the match length itself where a window
at or below the match point reaches back far enough (a conversation no longer than W holds all
its positions), else the deepest window end on the path. A window cell shared by two windows is
held once (counted here). The windows of a pool stay within Memory.index_budget: the least
recently used leaves go first, and a leaf that is left without a window (an upper node of a
split whose windows all went) goes with it, since no match can end there.
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
    # per sliding-window pool: the held cells of positions [end - len, end) (None: no window)
    window: list[np.ndarray] | None = None

    @property
    def end(self) -> int:
        return self.start + int(self.tokens.shape[0])


@dataclass(slots=True)
class RadixMatch:
    length: int
    cells: np.ndarray  # [length] int64: the cells of positions 0..length-1
    node: Node | None  # the deepest node the match reaches (for touch and lock)
    windows: list[np.ndarray] = field(default_factory=list)  # per window pool: cells to take


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
        self.windows = memory.index_windows  # W per sliding-window pool (pool 1 + i)
        self.budget = memory.index_budget
        sizes = [p.cells.n_cells for p in memory.pools[1 : 1 + len(self.windows)]]
        self._refs = [np.zeros(n, dtype=np.int32) for n in sizes]  # windows holding each cell
        self.num_window_cells = [0 for _ in self.windows]

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
        cells = np.concatenate(parts) if parts else _EMPTY
        if not self.windows or last is None:
            return RadixMatch(i, cells, last)
        return self._windowed(i, cells, last)

    def insert(
        self,
        tokens: np.ndarray,
        cells: np.ndarray,
        lora: LoraKey = (),
        lora_name: str | None = None,
        window: list[tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> int:
        """Index `tokens` whose cells (positions 0..n-1) are `cells`; the memory holds those
        of the part the tree did not have (the rest are the caller's to free). -> how many.
        With sliding-window pools, `window` gives per pool (cells, positions) of the run that
        ends at n - 1 (Memory.seq_window_cells); nothing is indexed without one, or when the
        windows' budget cannot take it."""
        assert tokens.shape == cells.shape
        if self.windows and (window is None or not self._fit(window)):
            return 0
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
        if self.windows and window is not None and node.window is None and node.parent is not None:
            node.window = [c.copy() for c, _ in window]
            self._hold_window(node.window)
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

    def held_windows(self) -> list[np.ndarray]:
        """Per sliding-window pool: the distinct cells the windows hold (for checks)."""
        return [np.flatnonzero(r) for r in self._refs]

    # -- windows (sliding-window pools) ----------------------------------------------------------

    def _windowed(self, length: int, cells: np.ndarray, last: Node) -> RadixMatch:
        """The match of `length` tokens cut back to the longest length a held window serves:
        `length` itself where a window at or below the match point reaches back far enough,
        else the end of the deepest node on the path that has one at or below it."""
        below = self._window_below(last, length)
        if below is not None:
            return self._with_window(length, cells, below)
        walk = last.parent  # `last` ends at or past `length`: already searched
        while walk is not None and walk.parent is not None:
            below = self._window_below(walk, walk.end)
            if below is not None:
                return self._with_window(walk.end, cells[: walk.end], below)
            walk = walk.parent
        return RadixMatch(0, _EMPTY, None)

    def _window_below(self, top: Node, m: int, limit: int = 256) -> Node | None:
        """A node in `top`'s subtree (itself included) whose window covers [m - W + 1, m) in
        every pool. NOTE: a window holds at most W positions before its end, so only nodes
        that end by max(m + 1, W) can cover: deeper ones are not looked at (nor more than
        `limit` nodes)."""
        bound = min(max(m + 1, w) for w in self.windows)
        stack = [top]
        seen = 0
        while stack and seen < limit:
            node = stack.pop()
            seen += 1
            if node.end > bound:
                continue
            if node.window is not None and self._covers(node, m):
                return node
            stack.extend(node.children.values())
        return None

    def _covers(self, node: Node, m: int) -> bool:
        assert node.window is not None and m <= node.end
        for w, cells in zip(self.windows, node.window, strict=True):
            first = node.end - int(cells.shape[0])
            if first > max(0, m - w + 1):
                return False
        return True

    def _with_window(self, m: int, cells: np.ndarray, node: Node) -> RadixMatch:
        """A match of length m whose window cells come from `node` (positions < m, at most W
        of them: what pruning would leave a sequence at m)."""
        assert node.window is not None
        take = []
        for w, held in zip(self.windows, node.window, strict=True):
            first = node.end - int(held.shape[0])
            lo, hi = max(first, m - w) - first, m - first
            take.append(held[lo:hi])
        return RadixMatch(m, cells[:m], node, take)

    def _fit(self, window: list[tuple[np.ndarray, np.ndarray]]) -> bool:
        """Room in every window pool for the cells of `window` not held yet, evicting LRU
        leaves for it; False when there is none."""
        while True:
            need = [int((self._refs[p][c] == 0).sum()) for p, (c, _) in enumerate(window)]
            over = [self.num_window_cells[p] + need[p] > b for p, b in enumerate(self.budget)]
            if not any(over):
                return True
            if any(need[p] > b for p, b in enumerate(self.budget)) or not self.evict_lru():
                return False

    def _hold_window(self, window: list[np.ndarray]) -> None:
        for p, cells in enumerate(window):
            fresh = cells[self._refs[p][cells] == 0]
            if fresh.size:
                self.memory.cells_hold(fresh, 1 + p)
            self._refs[p][cells] += 1
            self.num_window_cells[p] += int(fresh.size)

    def _release_window(self, node: Node) -> None:
        if node.window is None:
            return
        for p, cells in enumerate(node.window):
            self._refs[p][cells] -= 1
            gone = cells[self._refs[p][cells] == 0]
            if gone.size:
                self.memory.cells_release(gone, 1 + p)
            self.num_window_cells[p] -= int(gone.size)
        node.window = None

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
            self._release_window(node)
            node.alive = False
            self.num_nodes -= 1
            self.num_cells -= int(node.tokens.shape[0])
            if self.ledger is not None:
                self.ledger.remove(-node.uid)

    def _remove(self, leaf: Node) -> None:
        parent = leaf.parent
        assert parent is not None and not leaf.children and not leaf.lock
        self.memory.cells_release(leaf.cells)
        self._release_window(leaf)
        del parent.children[int(leaf.tokens[0])]
        leaf.alive = False
        self.num_nodes -= 1
        self.num_cells -= int(leaf.tokens.shape[0])
        if self.ledger is not None:
            self.ledger.remove(-leaf.uid)
        if parent.parent is not None and not parent.children:
            if self.windows and parent.window is None and not parent.lock:
                self._remove(parent)  # no match can end there any more
                return
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
