"""A small engine that honours scheduler.engine.Engine's contract, for route tests without a model.

Byte-level tokenizer (ids 0..255 are bytes, so multi-byte characters span tokens), and a
deterministic reply per choice; tokens are paced by asyncio sleeps so streams interleave.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from kvcache.cells import FREE
from scheduler.config import EngineConfig
from scheduler.errors import EngineDrainingError, QueueFullError
from scheduler.intake import check_request
from scheduler.request import EmbeddingEvent, Event, FinishEvent, Request, TokenEvent
from scheduler.stats import CellMapSnapshot, EngineStats, SlotInfo
from server.backend import Backend
from server.engine_client import EngineClient

BOS, EOS = 256, 257
EMBEDDING_DIM = 8
REPLY = "The capital of France is Paris. Ünïcødé 😀 ok."


class FakeTokenizer:
    bos_id: int | None = BOS
    eos_ids = (EOS,)
    vocab_size = 258

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return ([BOS] if add_special else []) + list(text.encode())  # no special spellings

    def token_bytes(self, token_id: int) -> bytes:
        return {BOS: b"<s>", EOS: b"</s>"}.get(token_id, bytes([token_id % 256]))

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode(errors="replace")


class FakeTemplate:
    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: object
    ) -> str:
        if any(m["role"] == "tool" for m in messages):
            raise ValueError("tool messages are not supported by this template")
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


@dataclass
class _Live:
    request: Request
    index: int
    cells: int
    state: str = "decode"
    num_generated: int = 0
    aborted: bool = False


@dataclass
class FakeEngine:
    n_cells: int = 4096
    max_queue: int = 64
    max_running: int = 64
    token_delay: float = 0.002
    reply: str = REPLY  # what every choice answers (its UTF-8 bytes are the tokens)
    live: dict[tuple[str, int], _Live] = field(default_factory=dict)
    draining: bool = False
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    submitted: list[Request] = field(default_factory=list)

    @property
    def config(self) -> EngineConfig:
        """What the admission check (scheduler/intake.py) reads: a 4000-token context."""
        return EngineConfig(self.n_cells, 64, 512, n_ctx_seq=min(4000, self.n_cells))

    def start(self) -> None:
        pass

    def submit(self, request: Request) -> AsyncIterator[Event]:
        asyncio.get_running_loop()
        if self.draining:
            raise EngineDrainingError("draining")
        with self.lock:
            running = {k[0] for k in self.live}
            if len(running) >= self.max_running:
                raise QueueFullError("queue full")
            check_request(request, self.config)  # after the 503 / 429, as Engine.submit
            for i in range(request.n):
                self.live[(request.req_id, i)] = _Live(request, i, len(request.prompt_ids))
            self.num_prompt_tokens += len(request.prompt_ids)
            self.submitted.append(request)
        return self._embed(request) if request.embed else self._run(request)

    async def _embed(self, request: Request) -> AsyncIterator[Event]:
        """A vector that depends only on the prompt (seeded by its crc32), after one step."""
        try:
            await asyncio.sleep(self.token_delay)
            ids = np.asarray(request.prompt_ids, dtype=np.int64)
            seed = zlib.crc32(ids.tobytes())
            vector = np.random.default_rng(seed).normal(size=EMBEDDING_DIM).astype(np.float32)
            yield EmbeddingEvent(0, vector * 3.0)  # not normalised, as the engine's are not
            yield FinishEvent(0, "stop", len(request.prompt_ids), 0, 0, queue_time=0.001)
        finally:
            with self.lock:
                self.live.pop((request.req_id, 0), None)

    async def _run(self, request: Request) -> AsyncIterator[Event]:
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._choice(request, i, queue)) for i in range(request.n)]
        try:
            for _ in range(request.n):
                while True:
                    event = await queue.get()
                    yield event
                    if isinstance(event, FinishEvent):
                        break
        finally:
            for t in tasks:
                t.cancel()
            with self.lock:
                for i in range(request.n):
                    self.live.pop((request.req_id, i), None)

    async def _choice(self, request: Request, index: int, queue: asyncio.Queue) -> None:
        reply = list(self.reply.encode())
        if request.sampling.temperature > 0 and request.sampling.seed is not None:
            rng = random.Random(request.sampling.seed)
            rng = random.Random(rng.random() + index)
            reply = reply[:4] + rng.sample(reply[4:], len(reply) - 4)
        tokens = reply + [EOS]
        live = self.live[(request.req_id, index)]
        reason, n_out = "length", 0
        for n_out, tok in enumerate(tokens[: request.max_tokens], start=1):  # noqa: B007
            await asyncio.sleep(self.token_delay)
            if live.aborted:
                reason = "abort"
                break
            lp = -0.25 if tok != EOS else -1.0
            top = [(tok, lp), ((tok + 1) % 256, -2.0)]
            live.num_generated += 1
            live.cells += 1
            with self.lock:
                self.num_generated_tokens += 1
            queue.put_nowait(TokenEvent(index, tok, lp, top if request.sampling.logprobs else None))
            if tok in request.stop_token_ids and not request.ignore_eos:
                reason = "stop"
                break
        with self.lock:
            self.live.pop((request.req_id, index), None)
        n_prompt = len(request.prompt_ids)
        queue.put_nowait(FinishEvent(index, reason, n_prompt, 0, n_out, queue_time=0.001))

    def abort(self, req_id: str, index: int | None = None) -> None:
        with self.lock:
            for (rid, i), live in self.live.items():
                if rid == req_id and (index is None or i == index):
                    live.aborted = True

    def stats(self) -> EngineStats:
        with self.lock:
            used = sum(v.cells for v in self.live.values())
            return EngineStats(
                num_waiting=0,
                num_running=len(self.live),
                n_cells=self.n_cells,
                cells_used=used,
                cells_shared=0,
                cells_cached=0,
                prefix_cache_queried_tokens=self.num_prompt_tokens,
                prefix_cache_hit_tokens=0,
                num_context_shifts=0,
                num_preemptions=0,
                num_prompt_tokens=self.num_prompt_tokens,
                num_generated_tokens=self.num_generated_tokens,
                num_steps=0,
                alive=True,
                draining=self.draining,
            )

    def slots(self) -> list[SlotInfo]:
        with self.lock:
            return [
                SlotInfo(
                    rid,
                    i,
                    seq,
                    v.state,
                    len(v.request.prompt_ids),
                    0,
                    v.num_generated,
                    v.cells,
                    0,
                    0,
                    v.cells - 1,
                )
                for seq, ((rid, i), v) in enumerate(self.live.items())
            ]

    def cell_map(self) -> CellMapSnapshot:
        """Each live choice's cells laid out one after another, in slot order."""
        slots = self.slots()
        owner_map = np.full(self.n_cells, FREE, dtype=np.int32)
        head = 0
        for slot in slots:
            owner_map[head : head + slot.cells_owned] = slot.seq_id
            head = min(self.n_cells, head + slot.cells_owned)
        return CellMapSnapshot(self.n_cells, head, owner_map, slots, [], self.stats())

    def shutdown(self, drain_timeout: float) -> None:
        self.draining = True
        deadline = time.monotonic() + drain_timeout
        while self.live and time.monotonic() < deadline:
            time.sleep(0.01)
        with self.lock:
            for live in self.live.values():
                live.aborted = True


def fake_backend_factory(engine: EngineClient | None = None):
    def factory(settings, on_step) -> Backend:
        return Backend(
            engine=engine or FakeEngine(),
            tokenizer=FakeTokenizer(),
            chat_template=FakeTemplate(),
            model_name=settings.served_model_name or "fake-model",
            n_ctx_seq=settings.ctx_per_seq,
            n_cells=4096,
            cache_bytes=4096 * 1024,
            embedding_dim=EMBEDDING_DIM,
        )

    return factory
