"""Two cellserve replicas behind sglang-router's cache_aware policy, under concurrent load
(tests/deploy/test_router_replicas.py has the fleet): shared prefixes in flight together hit
>= 95% of an ideal cache's tokens; a replica killed with SIGKILL fails only the requests in
flight when it died; a replica sent SIGTERM answers 503 on /health, finishes its streams, and
no request through the router fails meanwhile. Skips without sglang-router."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from tests.deploy.test_router_replicas import (
    QUESTIONS,
    REPLICA_FLAGS,
    SYSTEMS,
    _chat,
    _counter,
    _ideal_hit_tokens,
    sglang_fleet,
)


@dataclass(frozen=True)
class Sent:
    start: float
    end: float
    status: int  # -1: the connection failed


def _load(router: str, stop: threading.Event, sent: list[Sent], seed: int) -> None:
    """One closed-loop client: 24-token replies over the shared systems until `stop`."""
    i = 0
    with httpx.Client(timeout=60) as client:  # NOTE: one client: a new one loads the CA store
        while not stop.is_set():
            body = {
                "messages": [
                    {"role": "system", "content": SYSTEMS[(seed + i) % 2]},
                    {"role": "user", "content": f"Client {seed}, question {i}"},
                ],
                "max_tokens": 24,
                "ignore_eos": True,
                "temperature": 0,
            }
            t0 = time.monotonic()
            try:
                status = client.post(f"{router}/v1/chat/completions", json=body).status_code
            except httpx.HTTPError:
                status = -1
            sent.append(Sent(t0, time.monotonic(), status))
            i += 1


@contextmanager
def _clients(router: str, n: int, sent: list[Sent]) -> Iterator[threading.Event]:
    """`n` closed-loop clients until the returned event is set, and always stopped and joined
    on the way out: a test failing mid-way must not leave them looping (they once kept a whole
    CI run's later tests on a busy machine for half an hour)."""
    stop = threading.Event()
    threads = [
        threading.Thread(target=_load, args=(router, stop, sent, k), daemon=True) for k in range(n)
    ]
    for t in threads:
        t.start()
    try:
        yield stop
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=90)


def test_shared_prefixes_in_flight_together_hit_95_percent_of_an_ideal_cache() -> None:
    with sglang_fleet() as fleet:
        urls = [r.url for r in fleet.replicas]
        systems = [f"Desk {k}. {SYSTEMS[k % 2]} " * 3 for k in range(4)]
        workload = [(s, q) for q in QUESTIONS for s in systems]  # interleaved
        before = {u: _counter(u, "cellserve_prefix_cache_hit_tokens") for u in urls}
        with ThreadPoolExecutor(8) as pool:  # 8 in flight: two of each system at a time
            replies = list(pool.map(lambda sq: _chat(fleet.router, *sq), workload))
        assert [r.status_code for r in replies] == [200] * len(workload)
        hit = sum(_counter(u, "cellserve_prefix_cache_hit_tokens") - before[u] for u in urls)
        prompts = []
        for system, question in workload:
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
            rendered = httpx.post(
                f"{urls[0]}/v1/chat/completions/render", json={"messages": messages}, timeout=30
            )
            prompts.append(rendered.json()["token_ids"])
    ideal = _ideal_hit_tokens(prompts)
    print(f"in flight together: fleet prefix hits {hit:.0f}, ideal {ideal} ({hit / ideal:.1%})")
    assert hit >= 0.95 * ideal, (hit, ideal)


def test_sigkill_under_load_fails_only_the_requests_in_flight_on_the_victim() -> None:
    with sglang_fleet() as fleet:
        sent: list[Sent] = []
        with _clients(fleet.router, 6, sent):
            time.sleep(3)
            victim = fleet.replicas[1]
            victim.process.kill()  # SIGKILL: no drain
            killed_at = time.monotonic()
            victim.process.wait(timeout=10)
            time.sleep(6)
    in_flight = [s for s in sent if s.start < killed_at < s.end]
    failed = [s for s in sent if s.status != 200]
    after = [s for s in sent if s.start > killed_at]
    print(
        f"SIGKILL: {len(sent)} requests, {len(in_flight)} in flight at the kill, "
        f"{len(failed)} failed ({[s.status for s in failed]}), {len(after)} sent after"
    )
    assert len(after) > 10 and len(sent) - len(after) > 10
    late = [s for s in failed if s.start > killed_at]
    assert not late, f"{len(late)} requests sent after the kill failed: {late[:3]}"


def _stream_direct(url: str, started: threading.Event, out: list[dict]) -> None:
    """A long stream straight to one replica: its last chunk's finish_reason and token count."""
    # NOTE: long enough to be in flight at the SIGTERM a second after they start: 400 tokens of
    # the tiny model took ~1 s idle, so the replica sometimes had nothing left to drain and had
    # exited before /health was asked (ConnectError)
    body = {"prompt": "Tell a story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    num_chunks, finish = 0, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            started.set()
            choice = json.loads(line[6:])["choices"][0]
            num_chunks += 1
            finish = choice["finish_reason"] or finish
    out.append({"num_chunks": num_chunks, "finish_reason": finish})


def test_sigterm_drains_while_the_router_moves_new_requests_away() -> None:
    # --drain-grace 2.5: the router's health check (every 1 s, plus its timeout) sees the 503
    # before the replica stops admitting; without it a request routed in that second gets 503
    with sglang_fleet(replica_flags=[*REPLICA_FLAGS, "--drain-grace", "2.5"]) as fleet:
        victim = fleet.replicas[1]
        streams: list[dict] = []
        started = [threading.Event() for _ in range(3)]
        direct = [
            threading.Thread(target=_stream_direct, args=(victim.url, e, streams)) for e in started
        ]
        for t in direct:
            t.start()
        assert all(e.wait(30) for e in started)
        sent: list[Sent] = []
        try:
            with _clients(fleet.router, 4, sent):
                time.sleep(1)
                victim.terminate()
                term_at = time.monotonic()
                health = 200
                while health == 200 and time.monotonic() < term_at + 5:
                    try:
                        health = httpx.get(f"{victim.url}/health", timeout=5).status_code
                    except httpx.ConnectError:
                        health = -1  # gone: it did not drain while its streams ran
                victim.process.wait(timeout=180)
                exited_at = time.monotonic()
                time.sleep(2)
        finally:
            for t in direct:
                t.join(timeout=60)
    during = [s for s in sent if term_at < s.start and s.end < exited_at]
    print(
        f"SIGTERM: drained in {exited_at - term_at:.1f} s, streams {streams}, "
        f"{len(sent)} routed ({len(during)} during the drain), statuses "
        f"{sorted({s.status for s in sent})}"
    )
    assert health == 503
    assert victim.process.returncode == 0
    assert [s["finish_reason"] for s in streams] == ["length"] * 3  # all 2000 tokens
    assert during, "no routed request fell inside the drain"
    assert [s.status for s in sent] == [200] * len(sent)
