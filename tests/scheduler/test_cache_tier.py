"""The prefix cache's second tier (scheduler/cache_tier.py + kvcache/tier_store.py): finished
prompts evicted from a small live cache come back from host RAM or disk as prefix hits, with
exactly the cold output (the fake worker checks every row's context and K rotation), on the
unified and the sliding-window memory; a restarted disk tier finds its files; damaged files and
another model's are never restored; budgets evict least recently used entries."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvcache.spec import Attention, MemorySpec
from kvcache.tier_store import DiskStore, RamStore
from scheduler.cache_tier import CacheTier
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.scheduler.fakes import (
    FakeWorker,
    Outcome,
    make_config,
    make_prompt,
    make_request,
    reference_output,
)
from tests.scheduler.fakes import step as checked_step

W = 16
SPECS = {
    "unified": (None, (0,)),
    "iswa": (MemorySpec.of([Attention(1, 4), Attention(1, 4, W)]), (0, W)),
}
MODEL = "f" * 64


class TierWorker(FakeWorker):
    """The fake worker's cell contents (token, K position) as a storage's rows."""

    def __init__(self, n_cells: int, n_groups: int) -> None:
        super().__init__(n_cells)
        self.token = [np.full(n_cells, -1, dtype=np.int64) for _ in range(n_groups)]
        self.k_pos = [np.full(n_cells, -1, dtype=np.int64) for _ in range(n_groups)]

    def read_rows(self, cells: list[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (
                torch.from_numpy(self.token[g][c].copy()).view(1, 1, -1, 1),
                torch.from_numpy(self.k_pos[g][c].copy()).view(1, 1, -1, 1),
            )
            for g, c in enumerate(cells)
        ]

    def write_rows(self, cells: list[np.ndarray], rows: list) -> None:
        for g, (c, (k, v)) in enumerate(zip(cells, rows, strict=True)):
            self.token[g][c] = k.reshape(-1).numpy()
            self.k_pos[g][c] = v.reshape(-1).numpy()

    def kv_geometry(self) -> list[dict[str, object]]:
        geo = {"n_layers": 1, "n_kv_heads": 1, "k_row": 1, "k_dtype": "int64"}
        geo |= {"v_row": 1, "v_dtype": "int64"}
        return [dict(geo) for _ in self.token]


def make(kind: str, stores: list, n_cells: int = 400) -> tuple[Scheduler, TierWorker, CacheTier]:
    spec, _ = SPECS[kind]
    config = make_config(
        memory_spec=spec, n_cells=n_cells, n_seq_max=4, n_batch=64, n_ctx_seq=n_cells
    )
    sched = Scheduler(config)
    worker = TierWorker(config.n_cells, len(sched.memory.group_pools))
    return sched, worker, CacheTier(stores, MODEL, min_tokens=32)


def run(sched: Scheduler, worker: TierWorker, tier: CacheTier, reqs: list[Request]) -> Outcome:
    outcome = Outcome()
    for r in reqs:
        sched.add_request(r)
    while sched.has_work:
        tier.before_schedule(sched, worker)
        checked_step(sched, worker, outcome)
        tier.after_update(sched, worker)
        assert outcome.num_steps < 5000
    return outcome


def conversation(i: int, n: int = 150) -> Request:
    req = make_request(f"c{i}", max_tokens=6)
    req.prompt_ids = make_prompt(n, seed=100 + i)
    return req


def follow_up(first: Request, out: Outcome, n_new: int = 10) -> Request:
    req = make_request(first.req_id + "-next", max_tokens=8)
    req.prompt_ids = first.prompt_ids + out.tokens[(first.req_id, 0)] + make_prompt(n_new, 7)
    return req


def fill(sched: Scheduler, worker: TierWorker, tier: CacheTier, kind: str) -> tuple:
    """Five conversations through a cache that holds two: the first is evicted live."""
    first = conversation(0)
    out = run(sched, worker, tier, [first])
    for i in range(1, 5):
        run(sched, worker, tier, [conversation(i)])
    assert not any(
        sched.prefix.tokens(s)[:150].tolist() == first.prompt_ids for s in sched.prefix.seq_ids
    ), "the live cache still holds the first conversation"
    return first, out


def check_follow_up(sched, worker, tier, kind: str, first: Request, out: Outcome) -> Outcome:  # noqa: ANN001
    nxt = follow_up(first, out)
    got = run(sched, worker, tier, [nxt])
    assert got.finish[(nxt.req_id, 0)].num_cached_tokens >= 150
    windows = SPECS[kind][1]
    assert (
        got.tokens[(nxt.req_id, 0)]
        == reference_output(nxt, sched.config.n_ctx_seq, windows=windows)[0]
    )
    sched.memory.check()
    return got


@pytest.mark.parametrize("kind", list(SPECS))
def test_an_evicted_conversation_comes_back_from_ram(kind: str) -> None:
    sched, worker, tier = make(kind, [RamStore(1 << 30, MODEL)])
    first, out = fill(sched, worker, tier, kind)
    assert tier.stats[0].saves == 5 and tier.stats[0].entries == 5
    check_follow_up(sched, worker, tier, kind, first, out)
    assert tier.stats[0].hits == 1 and tier.stats[0].hit_tokens >= 150


@pytest.mark.parametrize("kind", list(SPECS))
def test_a_restarted_disk_tier_serves_what_it_wrote(tmp_path: Path, kind: str) -> None:
    sched, worker, tier = make(kind, [DiskStore(tmp_path, 1 << 30, MODEL)])
    first, out = fill(sched, worker, tier, kind)
    tier.close()  # the writes finish, as on a drained shutdown
    assert len(list(tmp_path.glob("*.cells"))) == 5
    # a new process: fresh scheduler, worker and tier on the same folder
    sched, worker, tier = make(kind, [DiskStore(tmp_path, 1 << 30, MODEL)])
    assert tier.stats[0].entries == 5
    check_follow_up(sched, worker, tier, kind, first, out)
    assert tier.stats[0].hits == 1
    # another model's tier sees none of these files
    other = CacheTier([DiskStore(tmp_path, 1 << 30, "0" * 64)], "0" * 64)
    assert other.stats[0].entries == 0
    tier.close()
    other.close()


def test_damaged_files_are_discarded_and_the_request_computes_cold(tmp_path: Path) -> None:
    sched, worker, tier = make("unified", [DiskStore(tmp_path, 1 << 30, MODEL)])
    first, out = fill(sched, worker, tier, "unified")
    tier.close()
    for path in tmp_path.glob("*.cells"):  # flip a byte in each payload
        raw = bytearray(path.read_bytes())
        raw[-5] ^= 0xFF
        path.write_bytes(bytes(raw))
    sched, worker, tier = make("unified", [DiskStore(tmp_path, 1 << 30, MODEL)])
    nxt = follow_up(first, out)
    got = run(sched, worker, tier, [nxt])
    assert got.finish[(nxt.req_id, 0)].num_cached_tokens == 0
    assert got.tokens[(nxt.req_id, 0)] == reference_output(nxt, sched.config.n_ctx_seq)[0]
    assert tier.stats[0].failed_loads == 1 and tier.stats[0].hits == 0
    tier.close()
    # the damaged file that was read is deleted; the follow-up's own conversation is written
    key = tier.key(np.asarray(first.prompt_ids + out.tokens[(first.req_id, 0)][:-1]))
    assert not (tmp_path / f"{key}.cells").exists()
    assert len(list(tmp_path.glob("*.cells"))) == 5


def test_budgets_keep_the_most_recently_used_entries(tmp_path: Path) -> None:
    one = 5000  # a bit more than one 155-token entry: tokens, positions, K and V, 8 bytes each
    sched, worker, tier = make(
        "unified", [RamStore(2 * one, MODEL), DiskStore(tmp_path, 3 * one, MODEL)]
    )
    fill(sched, worker, tier, "unified")
    tier.close()
    assert tier.stats[0].entries == 2 and tier.stats[1].entries == 3
    assert tier.stats[0].bytes <= 2 * one and tier.stats[1].bytes <= 3 * one
    assert len(list(tmp_path.glob("*.cells"))) == 3
    newest = [conversation(i).prompt_ids for i in (2, 3, 4)]
    kept = [e.tokens[:150].tolist() for e in tier.index[1].values()]
    assert sorted(kept) == sorted(newest)


def test_entries_serve_only_requests_under_the_same_lora_adapters(tmp_path: Path) -> None:
    """K/V computed under a LoRA adapter is that adapter's: the disk tier keeps the key in its
    files, and a base-model request with the same tokens never restores it."""
    adapter = ((0, 0.5),)
    sched, worker, tier = make("unified", [DiskStore(tmp_path, 1 << 30, MODEL)])
    first = conversation(0)
    first.lora, first.lora_name = adapter, "sql"
    out = run(sched, worker, tier, [first])
    for i in range(1, 5):
        run(sched, worker, tier, [conversation(i)])
    tier.close()
    sched, worker, tier = make("unified", [DiskStore(tmp_path, 1 << 30, MODEL)])
    assert sum(e.lora == adapter for e in tier.index[0].values()) == 1
    base = follow_up(first, out)
    got = run(sched, worker, tier, [base])
    assert got.finish[(base.req_id, 0)].num_cached_tokens == 0 and tier.stats[0].hits == 0
    same = follow_up(first, out)
    same.req_id, same.lora, same.lora_name = "same", adapter, "sql"
    got = run(sched, worker, tier, [same])
    assert got.finish[("same", 0)].num_cached_tokens >= 150 and tier.stats[0].hits == 1
    held = [s for s in sched.prefix.seq_ids if sched.prefix.lora(s) == adapter]
    assert held and sched.prefix.lora_name(held[0]) == "sql"
    sched.memory.check()
    tier.close()


def test_kv_of_an_adapter_loaded_at_runtime_is_not_kept() -> None:
    """Ids past the start-up adapters' (server/lora_runtime.py) may name another adapter after
    a restart: nothing computed under them goes to a tier."""
    sched, worker, _ = make("unified", [])
    tier = CacheTier([RamStore(1 << 30, MODEL)], MODEL, min_tokens=32, num_fixed_loras=1)
    fixed, runtime = conversation(0), conversation(1)
    fixed.lora, runtime.lora = ((0, 1.0),), ((1, 1.0),)
    run(sched, worker, tier, [fixed, runtime])
    assert [e.lora for e in tier.index[0].values()] == [((0, 1.0),)]


def test_a_conversation_evicted_from_the_prefix_index_comes_back_from_ram() -> None:
    # two seq ids: a holder is demoted into the prefix index when a later conversation needs its
    # seq id; 700 cells hold four conversations, so the fifth evicts the index's oldest leaf
    config = make_config(n_cells=700, n_seq_max=2, n_batch=64, n_ctx_seq=700)
    sched = Scheduler(config)
    radix = sched.seq_ids.radix
    assert radix is not None
    worker = TierWorker(config.n_cells, len(sched.memory.group_pools))
    tier = CacheTier([RamStore(1 << 30, MODEL)], MODEL, min_tokens=32)
    run(sched, worker, tier, [conversation(0)])
    second = conversation(1)
    out = run(sched, worker, tier, [second])
    prompt = np.array(second.prompt_ids, dtype=np.int64)
    run(sched, worker, tier, [conversation(2)])
    assert radix.match(prompt).length == 150, "demoted into the index, not dropped"
    assert all(sched.prefix.tokens(s)[:150].tolist() != second.prompt_ids for s in (0, 1))
    for i in range(3, 5):
        run(sched, worker, tier, [conversation(i)])
    assert radix.match(prompt).length == 0, "the index still holds the conversation"
    assert all(sched.prefix.tokens(s)[:150].tolist() != second.prompt_ids for s in (0, 1))
    check_follow_up(sched, worker, tier, "unified", second, out)
    assert tier.stats[0].hits == 1 and tier.stats[0].hit_tokens >= 150
