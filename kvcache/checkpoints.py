"""Where a recurrent memory's prompt steps take state checkpoints (kvcache/recurrent.py).

A multi-row (prompt) step over positions [p_first, p_last] copies the state after [0, m) for
m = p_last (the state before the last prompt token: the scheduler matches a new prompt's
tokens[:n-1], so this serves an identical prompt) and for the multiples of the interval it
crosses (a shared system prompt): the newest one, and those at interval x 2^j, which a
sequence keeps (`lasting`); a later prompt step replaces the others, so a long prompt keeps
about log2(length / interval) + 2 states, not one per chunk.
"""

from __future__ import annotations


def capture_points(p_first: int, p_last: int, interval: int) -> list[int]:
    """Checkpoints of a step over positions [p_first, p_last], most useful first: before
    the last row, the newest grid point, then the lasting ones."""
    if p_last == p_first:
        return []
    grid = [m for m in range((p_first // interval + 1) * interval, p_last + 2, interval)]
    grid = [m for m in grid if m != p_last]
    kept = sorted((m for m in grid[:-1] if lasting(m, interval)), reverse=True)
    return [p_last, *grid[-1:], *kept]


def lasting(m: int, interval: int) -> bool:
    """Whether a sequence keeps its checkpoint at m once a later prompt step took newer ones:
    grid points at interval x 2^j (a spread over any length: log2(n / interval) states per
    sequence, not n / interval). The others (the end of an earlier prompt chunk, the newest
    grid point) serve until the next prompt step replaces them."""
    q, r = divmod(m, interval)
    return r == 0 and q & (q - 1) == 0
