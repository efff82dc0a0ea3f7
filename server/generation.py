"""Run engine requests for one HTTP request and turn their events into per-choice text deltas.

One HTTP request may hold several engine requests (a batch of completion prompts); choice
indices are global: prompt p's choice j is `p * n + j`, as in OpenAI's API.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from scheduler.request import FinishEvent, Request, TokenEvent
from server.backend import Backend
from server.errors import engine_error
from server.metrics import Metrics
from server.streaming import TextStream


class GenerationError(Exception):
    """A request that cannot finish normally; `status` and `code` are its HTTP status and the
    error body's code (a JSON reply's status, a stream's error event)."""

    status = 500
    code = "engine_error"

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status or self.status
        self.code = code or self.code


class GenerationTimeout(GenerationError):
    status = 504
    code = "request_timeout"


class GenerationFailed(GenerationError):
    """The engine failed on the request (500), or the request's grammar could not be followed
    with the model's tokens (400 grammar_error)."""


class GenerationAborted(GenerationError):
    """The engine aborted a choice the client still waits for (the server shut down past its
    drain timeout): not an OpenAI finish_reason, so the request ends with a 503 / an error chunk."""

    status = 503
    code = "aborted"


# NOTE: what a client sees as finish_reason is always one of OpenAI's values. The engine's
# "stop" and "length" pass through; its internal "abort" and "error" end the request with an
# error instead (vLLM too keeps "abort" internal). "tool_calls" is set by the tool-call parser.
OPENAI_FINISH_REASONS = frozenset(
    {"stop", "length", "tool_calls", "content_filter", "function_call"}
)


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class ChoiceDelta:
    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    stop_string: str | None = None  # with finish_reason "stop": the stop string that matched


@dataclass(slots=True)
class _Choice:
    job: int
    stream: TextStream
    num_tokens: int = 0
    last_token_time: float = 0.0
    done: bool = False


@dataclass(slots=True)
class _JobUsage:
    num_prompt: int = 0
    num_cached: int = 0
    num_output: dict[int, int] = field(default_factory=dict)
    seen_finish: bool = False


class Generation:
    def __init__(
        self,
        backend: Backend,
        metrics: Metrics,
        requests: list[Request],
        stops: list[str],
        timeout: float,
        want_logprobs: bool,
        max_buffered: int = 1024,
        prompt_param: str = "prompt",
    ) -> None:
        self.backend = backend
        self.prompt_param = prompt_param  # names the prompt in a 400 from the engine
        self.max_buffered = max_buffered  # unsent events before a slow reader is cut off
        self.metrics = metrics
        self.requests = requests
        self.timeout = timeout
        self.want_logprobs = want_logprobs
        self.arrival = time.monotonic()
        tok = backend.tokenizer
        skip = frozenset(int(t) for t in (*tok.eos_ids, *getattr(tok, "special_ids", ())))
        self.choices: list[_Choice] = []
        for j, req in enumerate(requests):
            for _ in range(req.n):
                stream = TextStream(backend.tokenizer.token_bytes, stops, skip)
                self.choices.append(_Choice(job=j, stream=stream))
        self.usage_by_job = [_JobUsage() for _ in requests]
        self._streams: list[AsyncIterator] = []
        self._first_token = False

    def submit(self) -> None:
        """Submit every engine request; on failure abort the ones already in and raise APIError."""
        for req in self.requests:
            try:
                self._streams.append(self.backend.engine.submit(req))
            except Exception as exc:
                self.abort()
                raise engine_error(exc, self.prompt_param) from exc

    def abort(self) -> None:
        for req in self.requests[: len(self._streams)]:
            self.backend.engine.abort(req.req_id)

    def cancel(self) -> None:
        """Timeout, client gone, or an engine error: abort what is unfinished. Idempotent."""
        if self.finished:
            return
        self.abort()
        for choice in self.choices:
            if not choice.done:
                choice.done = True
                self.metrics.requests.labels(finish_reason="abort").inc()

    def stop(self, index: int, reason: str = "stop") -> None:
        """Choice `index` ends here, a normal end counted under `reason` ("stop": a stop string;
        "length": a route's own limit, llama.cpp's n_indent); the engine drops the rest of it."""
        choice = self.choices[index]
        if choice.done:
            return
        choice.done = True
        in_job = index - self._index(choice.job, 0)
        self.backend.engine.abort(self.requests[choice.job].req_id, in_job)
        self.usage_by_job[choice.job].num_output[in_job] = choice.num_tokens
        self.metrics.requests.labels(finish_reason=reason).inc()

    @property
    def finished(self) -> bool:
        return all(c.done for c in self.choices)

    def usage(self) -> tuple[int, int, int]:
        """-> (prompt_tokens, completion_tokens, cached_tokens)."""
        num_prompt = sum(u.num_prompt for u in self.usage_by_job)
        num_cached = sum(u.num_cached for u in self.usage_by_job)
        num_output = sum(sum(u.num_output.values()) for u in self.usage_by_job)
        return num_prompt, num_output, num_cached

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [
            asyncio.create_task(self._pump(j, stream, queue))
            for j, stream in enumerate(self._streams)
        ]
        remaining = len(pumps)
        deadline = self.arrival + self.timeout
        try:
            while remaining:
                try:
                    item = await asyncio.wait_for(queue.get(), deadline - time.monotonic())
                except (asyncio.TimeoutError, TimeoutError) as exc:
                    raise GenerationTimeout(
                        f"the request ran longer than {self.timeout:g} s and was aborted"
                    ) from exc
                if isinstance(item, GenerationFailed):
                    raise item
                if isinstance(item, BaseException):
                    raise GenerationFailed(f"engine error: {item}") from item
                job, event = item
                if event is None:
                    remaining -= 1
                    continue
                delta = self._on_event(job, event)
                if delta is not None:
                    yield delta
            if not self.finished:  # an engine stream ended without this choice's finish
                raise GenerationAborted("the engine ended the request before it finished")
            self.metrics.e2e.observe(time.monotonic() - self.arrival, self.backend.model_name)
        finally:
            for pump in pumps:
                pump.cancel()
            self.cancel()

    async def _pump(self, job: int, stream: AsyncIterator, queue: asyncio.Queue) -> None:
        try:
            async for event in stream:
                queue.put_nowait((job, event))
                if queue.qsize() > self.max_buffered:
                    # NOTE: a client that stops reading must not make the server hold its whole
                    # generation: past max_buffered unsent events the request is aborted
                    self.abort()
                    queue.put_nowait(
                        GenerationFailed(
                            f"the client read the stream too slowly ({self.max_buffered} tokens "
                            "were waiting to be sent); the request was aborted"
                        )
                    )
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            queue.put_nowait(exc)
            return
        queue.put_nowait((job, None))

    def _index(self, job: int, choice: int) -> int:
        return sum(r.n for r in self.requests[:job]) + choice

    def _on_event(self, job: int, event: TokenEvent | FinishEvent) -> ChoiceDelta | None:
        index = self._index(job, event.index)
        choice = self.choices[index]
        if isinstance(event, TokenEvent):
            return self._on_token(job, index, choice, event)
        return self._on_finish(job, index, choice, event)

    def _on_token(
        self, job: int, index: int, choice: _Choice, ev: TokenEvent
    ) -> ChoiceDelta | None:
        if choice.done:
            return None
        now = time.monotonic()
        if not self._first_token:
            self._first_token = True
            self.metrics.ttft.observe(now - self.arrival, self.backend.model_name)
        if choice.last_token_time:
            self.metrics.itl.observe(now - choice.last_token_time, self.backend.model_name)
        choice.last_token_time = now
        choice.num_tokens += 1
        text = choice.stream.add(ev.token_id)
        if choice.stream.stopped:
            self.stop(index)
            return ChoiceDelta(index, text, [], "stop", choice.stream.stop_string)
        logprobs = []
        if self.want_logprobs and ev.logprob is not None:
            logprobs.append(TokenLogprob(ev.token_id, ev.logprob, list(ev.top_logprobs or [])))
        if not text and not logprobs:
            return None
        return ChoiceDelta(index, text, logprobs)

    def _on_finish(
        self, job: int, index: int, choice: _Choice, ev: FinishEvent
    ) -> ChoiceDelta | None:
        usage = self.usage_by_job[job]
        if not usage.seen_finish:
            usage.seen_finish = True
            usage.num_prompt = ev.num_prompt_tokens
            usage.num_cached = ev.num_cached_tokens
            self.metrics.queue_time.observe(ev.queue_time, self.backend.model_name)
        if choice.done:
            return None
        if ev.reason == "error" and ev.grammar_error:
            raise GenerationFailed(
                f"the model's tokens cannot follow the requested grammar here: {ev.error}",
                400,
                "grammar_error",
            )
        if ev.reason == "error":
            raise GenerationFailed(ev.error or "the engine failed on this request")
        if ev.reason not in OPENAI_FINISH_REASONS:
            raise GenerationAborted(
                f"the request was aborted before it finished ({ev.reason}): the server is "
                "shutting down"
            )
        choice.done = True
        usage.num_output[ev.index] = ev.num_output_tokens
        text = choice.stream.finish()
        reason = "stop" if choice.stream.stopped else ev.reason
        self.metrics.requests.labels(finish_reason=reason).inc()
        return ChoiceDelta(index, text, [], reason, choice.stream.stop_string)
