from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from scheduler.context_shift import clamp_n_keep, truncate_prompt
from scheduler.prefix_cache import PrefixCache


@given(n_ctx=st.integers(8, 300), n_prompt=st.integers(1, 2000), n_keep=st.integers(-1, 400))
def test_truncated_prompt_fits_and_keeps_its_head_and_tail(
    n_ctx: int, n_prompt: int, n_keep: int
) -> None:
    prompt = list(range(n_prompt))
    keep = clamp_n_keep(n_keep, n_prompt, n_ctx)
    out = truncate_prompt(prompt, keep, n_ctx)
    assert len(out) < n_ctx
    if n_prompt < n_ctx:
        assert out == prompt
    else:
        assert out[:keep] == prompt[:keep]
        tail = len(out) - keep
        assert out[keep:] == prompt[n_prompt - tail :]
        assert tail >= (n_ctx - keep) // 2


def make_index(*holders: list[int]) -> PrefixCache:
    index = PrefixCache()
    for sid, tokens in enumerate(holders):
        index.insert(sid, np.asarray(tokens, dtype=np.int64))
    return index


def test_match_is_the_longest_common_prefix() -> None:
    index = make_index([1, 2, 3, 4], [1, 2, 9], [7])
    m = index.match(np.asarray([1, 2, 3, 5, 6]))
    assert (m.seq_id, m.length) == (0, 3)
    m = index.match(np.asarray([1, 2, 9, 9]))
    assert (m.seq_id, m.length) == (1, 3)
    assert index.match(np.asarray([8])).seq_id == -1


def test_cover_and_lru() -> None:
    index = make_index([1, 2, 3], [4, 5])
    assert index.is_covered(np.asarray([1, 2]))
    assert not index.is_covered(np.asarray([1, 2, 3, 4]))
    assert index.covered_by(np.asarray([1, 2, 3, 4])) == [0]
    assert index.lru() == 0
    index.touch(0)
    assert index.lru() == 1
    assert index.lru(exclude=1) == 0
    index.remove(1)
    index.remove(0)
    assert index.lru() == -1
