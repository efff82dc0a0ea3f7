"""Run /v1/embeddings inputs through the engine as prompt-only requests (Request.embed) and
turn the pooled vectors into OpenAI's embeddings.

Pooling, for a generative (causal) model: the last prompt token's final-norm hidden state, the
only one that has attended to the whole input (vLLM's default pooling for decoder models); the
vector is L2-normalised, as OpenAI's are. An encoder embedding model (model/layers/encoder.py)
pools as its sentence-transformers config says and normalises only where that config does
(Backend.embedding_normalize). A request's `dimensions` cuts the vector of a model that declares
shortened (Matryoshka) ones (Backend.embedding_matryoshka) before that normalisation.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi import Request as HTTPRequest

from scheduler.request import EmbeddingEvent, FinishEvent, Request
from server.engine_client import EngineClient
from server.errors import APIError, engine_error

WINDOW = 32  # at most this many inputs of one HTTP request in the engine at once


class EmbeddingJob:
    def __init__(
        self,
        engine: EngineClient,
        requests: list[Request],
        params: list[str],
        timeout: float,
        max_queue: int,
    ) -> None:
        self.engine = engine
        self.requests = requests
        self.params = params  # the body field each request came from ("input", "input.3")
        self.timeout = timeout
        # NOTE: half the engine's queue at most, so that a big batch on an idle server is
        # served in turns instead of answering 429 (other clients keep the other half)
        self.window = max(1, min(WINDOW, max_queue // 2))
        self.num_prompt_tokens = 0
        self._live: set[str] = set()
        self._client_gone = False

    async def run(self, http: HTTPRequest) -> list[np.ndarray]:
        """-> one vector per request, in order; APIError on any failure (the rest aborted)."""
        window = asyncio.Semaphore(self.window)
        tasks = [asyncio.create_task(self._one(i, window)) for i in range(len(self.requests))]
        watcher = asyncio.create_task(self._watch(http, tasks))
        try:
            async with asyncio.timeout(self.timeout):
                return list(await asyncio.gather(*tasks))
        except asyncio.CancelledError:
            if self._client_gone:  # nobody reads the answer; the aborts below free the engine
                raise APIError(400, "the client disconnected", code="client_gone") from None
            raise
        except TimeoutError as exc:
            raise APIError(
                504,
                f"the request ran longer than {self.timeout:g} s and was aborted",
                code="request_timeout",
            ) from exc
        finally:
            watcher.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, watcher, return_exceptions=True)
            for req_id in self._live:
                self.engine.abort(req_id)

    async def _one(self, i: int, window: asyncio.Semaphore) -> np.ndarray:
        req = self.requests[i]
        async with window:
            try:
                stream = self.engine.submit(req)
            except Exception as exc:
                raise engine_error(exc, self.params[i]) from exc
            self._live.add(req.req_id)
            vector = None
            async for event in stream:
                if isinstance(event, EmbeddingEvent):
                    vector = event.vector
                elif isinstance(event, FinishEvent):
                    self._live.discard(req.req_id)
                    if event.reason == "error":
                        raise APIError(500, event.error or "engine error", code="engine_error")
                    if vector is None:
                        raise APIError(
                            503, "the request was aborted before it finished", code="aborted"
                        )
                    self.num_prompt_tokens += event.num_prompt_tokens
            if vector is None:
                raise APIError(503, "the engine ended the request early", code="aborted")
            return vector

    async def _watch(self, http: HTTPRequest, tasks: list[asyncio.Task]) -> None:
        while not await http.is_disconnected():
            await asyncio.sleep(0.25)
        self._client_gone = True
        for task in tasks:
            task.cancel()


def finish_vector(
    vector: np.ndarray, encoding_format: str, normalize: bool = True, dimensions: int | None = None
) -> list[float] | str:
    """Cut to the first `dimensions` values (a Matryoshka model's shortened vector), then
    L2-normalise (`normalize`); float -> list of floats, base64 -> little-endian float32 bytes,
    base64."""
    # NOTE: cut before normalising, as vLLM's pooler does and EmbeddingGemma's card asks: a
    # normalised model's shortened vector is a unit vector again
    v = np.asarray(vector[:dimensions], dtype=np.float64)
    norm = float(np.linalg.norm(v)) if normalize else 0.0
    unit = (v / norm if norm > 0 else v).astype("<f4")
    if encoding_format == "base64":
        return base64.b64encode(unit.tobytes()).decode("ascii")
    return unit.tolist()
