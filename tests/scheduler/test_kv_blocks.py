"""Virtual blocks over prefix-cache holders: stored - removed = the holders' blocks."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.kv_blocks import AllBlocksCleared, BlockLedger, BlockRemoved, BlockStored


def toks(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def replay(events, live: set[int] | None = None) -> set[int]:
    live = set() if live is None else live
    for e in events:
        if isinstance(e, BlockStored):
            assert not live & set(e.block_hashes), "a stored block was already stored"
            live |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            assert set(e.block_hashes) <= live, "a removed block was never stored"
            live -= set(e.block_hashes)
        else:
            live.clear()
    return live


def test_only_full_blocks_are_stored_as_one_chain():
    ledger = BlockLedger(block_size=4)
    ledger.add(0, toks(*range(10)))
    (stored,) = ledger.take()
    assert isinstance(stored, BlockStored)
    assert len(stored.block_hashes) == 2 and stored.parent_block_hash is None
    assert stored.token_ids == list(range(8))  # the partial block 8..9 is not announced


def test_a_shared_prefix_is_stored_once_and_removed_with_its_last_holder():
    ledger = BlockLedger(block_size=2)
    ledger.add(0, toks(1, 2, 3, 4))
    first = ledger.take()[0]
    ledger.add(1, toks(1, 2, 3, 4, 5, 6))
    (second,) = ledger.take()
    assert second.parent_block_hash == first.block_hashes[-1]  # the chain continues
    assert second.token_ids == [5, 6]
    ledger.remove(0)
    assert ledger.take() == []  # holder 1 still keeps both shared blocks
    ledger.remove(1)
    (removed,) = ledger.take()
    assert set(removed.block_hashes) == {*first.block_hashes, *second.block_hashes}


def test_same_tokens_give_the_same_hashes_in_every_ledger():
    a, b = BlockLedger(4), BlockLedger(4)
    a.add(0, toks(*range(12)))
    b.add(7, toks(*range(12)))
    assert a.blocks == b.blocks
    c = BlockLedger(4)
    c.add(0, toks(99, *range(1, 12)))  # a different first block changes every later hash
    assert not c.blocks & a.blocks


def test_clearing_sends_all_blocks_cleared_instead_of_removals():
    ledger = BlockLedger(2)
    ledger.add(0, toks(1, 2, 3, 4))
    ledger.take()
    ledger.remove(0)
    ledger.cleared()
    assert ledger.take() == [AllBlocksCleared()]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 5), st.lists(st.integers(0, 3), max_size=12)),
        max_size=40,
    )
)
def test_stored_minus_removed_is_the_holders_blocks(ops):
    ledger = BlockLedger(block_size=3)
    holders: dict[int, np.ndarray] = {}
    live: set[int] = set()
    for is_add, sid, tokens in ops:
        if is_add and sid not in holders:
            holders[sid] = toks(*tokens)
            ledger.add(sid, holders[sid])
        elif not is_add and sid in holders:
            del holders[sid]
            ledger.remove(sid)
        live = replay(ledger.take(), live)
        expected = {h for t in holders.values() for h, _, _ in ledger.chain(t)}
        assert live == expected == ledger.blocks


def test_blocks_under_an_adapter_are_their_own_with_its_lora_id():
    ledger = BlockLedger(block_size=4)
    tokens = np.arange(8, dtype=np.int64)
    ledger.add(0, tokens)
    ledger.add(1, tokens, ((0, 1.0),), "pirate")
    ledger.add(2, tokens, ((0, 0.5), (1, 1.0)), "pirate*0.5+poet")
    base, pirate, mix = ledger.take()
    assert isinstance(base, BlockStored) and isinstance(pirate, BlockStored)
    assert isinstance(mix, BlockStored)
    assert (base.lora_id, base.lora_name) == (None, None)
    assert (pirate.lora_id, pirate.lora_name) == (1, "pirate")  # vLLM's lora_int_id: id + 1
    assert mix.lora_id is not None and mix.lora_id > 1
    hashes = [set(e.block_hashes) for e in (base, pirate, mix)]
    assert all(len(h) == 2 for h in hashes)
    assert not (hashes[0] & hashes[1]) and not (hashes[0] & hashes[2])
    assert not (hashes[1] & hashes[2])
    assert base.token_ids == pirate.token_ids == list(range(8))


def test_a_running_holder_grows_is_cut_and_hands_its_blocks_to_a_cache_holder():
    ledger = BlockLedger(block_size=2)
    running = [1, 2, 3, 4, 5, 6, 7]
    ledger.hold_running({"r": (running, 3, (), None)})
    (first,) = ledger.take()
    assert first.token_ids == [1, 2]  # one full block computed so far
    ledger.hold_running({"r": (running, 6, (), None)})
    (grown,) = ledger.take()
    assert grown.parent_block_hash == first.block_hashes[-1] and grown.token_ids == [3, 4, 5, 6]
    ledger.hold_running({"r": (running, 2, (), None)})  # a context shift keeps 2 tokens
    (cut,) = ledger.take()
    assert cut == BlockRemoved(grown.block_hashes)
    ledger.hold_running({"r": (running, 6, (), None)})
    ledger.add(0, toks(*running[:6]))  # the request finished: a cache holder has it all
    ledger.hold_running({})
    assert len(ledger.take()) == 1 and len(ledger.blocks) == 3  # stored again once, kept
    ledger.remove(0)
    (removed,) = ledger.take()
    assert len(removed.block_hashes) == 3 and not ledger.blocks
