"""Load generator for any OpenAI-compatible server: streams requests, times them client-side.

Load is either a fixed number of sessions in flight (`concurrency`) or Poisson arrivals at
`request_rate` sessions per second (optionally capped by `concurrency`), as in
`vllm bench serve`. Works against cellserve, llama.cpp's llama-server and vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from bench.metrics import BenchMetrics, RequestResult, compute_metrics
from bench.workloads import PromptBuilder, Session, WorkloadSpec, build_sessions

CUT_OFF = "cut off at the time limit"
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(slots=True)
class LoadConfig:
    base_url: str  # server root (a trailing /v1 is dropped)
    model: str
    endpoint: str = "completions"
    output_len: int = 128
    ignore_eos: bool = True
    temperature: float = 0.0
    api_key: str | None = None
    timeout_s: float = 600.0
    max_duration_s: float | None = None  # no new session starts after this many seconds
    cutoff_s: float | None = None  # requests still running after this many seconds fail


@dataclass(slots=True)
class LoadResult:
    results: list[RequestResult]
    duration_s: float
    num_skipped: int = 0  # sessions not started before max_duration_s or cutoff_s


@dataclass(slots=True)
class LevelResult:
    concurrency: int | None
    request_rate: float
    num_skipped: int
    metrics: BenchMetrics
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "request_rate": None if math.isinf(self.request_rate) else self.request_rate,
            "num_skipped": self.num_skipped,
            **self.metrics.to_dict(),
            **self.extra,
        }


def root_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def arrival_intervals(n: int, request_rate: float, rng: np.random.Generator) -> np.ndarray:
    """Gaps before each of `n` arrivals: exponential with mean 1/rate (a Poisson process);
    all zero for an infinite rate."""
    if math.isinf(request_rate):
        return np.zeros(n)
    if request_rate <= 0:
        raise ValueError(f"request rate must be positive, got {request_rate}")
    return rng.exponential(1.0 / request_rate, size=n)


def build_body(
    cfg: LoadConfig, session: Session, history: list[tuple[str, str]], user: str
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": cfg.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        messages = [{"role": "system", "content": session.system}] if session.system else []
        for past_user, past_reply in history:
            messages.append({"role": "user", "content": past_user})
            messages.append({"role": "assistant", "content": past_reply})
        messages.append({"role": "user", "content": user})
        body["messages"] = messages
    else:
        parts = [session.system] if session.system else []
        for past_user, past_reply in history:
            parts += [past_user, past_reply]
        body["prompt"] = "\n\n".join([*parts, user])
    return body


def stream_chunks(url: str, body: dict[str, Any], timeout: float = 900) -> Iterator[dict]:
    """POST `body` to `url` as an SSE stream (synchronously): each `data:` chunk, parsed, until
    `[DONE]`; an HTTP error status raises."""
    with httpx.stream("POST", url, json=body, timeout=timeout) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def _chunk_text(choice: dict[str, Any], endpoint: str) -> str:
    if endpoint == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(
    client: httpx.AsyncClient, cfg: LoadConfig, body: dict[str, Any], prompt_tokens_guess: int
) -> tuple[RequestResult, str]:
    """Streams one request; returns its timings and the generated text."""
    result = RequestResult(success=False, num_prompt_tokens=prompt_tokens_guess)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    start = last = time.perf_counter()
    try:
        async with client.stream(
            "POST", ENDPOINTS[cfg.endpoint], json=body, headers=headers
        ) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:200]
                result.error = f"HTTP {resp.status_code}: {detail}"
                return result, ""
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    return result, ""
                usage = chunk.get("usage") or usage
                choices = chunk.get("choices") or []
                text = _chunk_text(choices[0], cfg.endpoint) if choices else ""
                if not text:
                    continue
                if pieces:
                    result.itl.append(now - last)
                else:
                    result.ttft = now - start
                last = now
                pieces.append(text)
    except (httpx.HTTPError, json.JSONDecodeError, AttributeError, TypeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result, ""
    if not pieces:
        result.error = "stream ended without output text"
        return result, ""
    result.success = True
    result.latency = last - start
    result.num_output_tokens = len(pieces)
    if usage:
        result.num_output_tokens = int(usage.get("completion_tokens") or len(pieces))
        result.num_prompt_tokens = int(usage.get("prompt_tokens") or prompt_tokens_guess)
    return result, "".join(pieces)


async def run_session(
    client: httpx.AsyncClient,
    cfg: LoadConfig,
    session: Session,
    results: list[RequestResult],
    pbar: tqdm,
) -> None:
    """Sends the session's turns in order, each with the history so far; stops at a failure."""
    history: list[tuple[str, str]] = []
    history_tokens = session.system_tokens
    for user, user_tokens in zip(session.user_turns, session.turn_tokens, strict=True):
        body = build_body(cfg, session, history, user)
        try:
            result, reply = await send_request(client, cfg, body, history_tokens + user_tokens)
        except asyncio.CancelledError:
            results.append(RequestResult(success=False, error=CUT_OFF))
            raise
        results.append(result)
        pbar.update(1)
        if not result.success:
            return
        history.append((user, reply))
        history_tokens += user_tokens + result.num_output_tokens


async def run_load(
    cfg: LoadConfig,
    sessions: list[Session],
    concurrency: int | None,
    request_rate: float = math.inf,
    seed: int = 0,
    progress: bool = True,
    desc: str = "",
) -> LoadResult:
    if concurrency is None and math.isinf(request_rate):
        raise ValueError("give a concurrency, a finite request rate, or both")
    gaps = arrival_intervals(len(sessions), request_rate, np.random.default_rng(seed))
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    results: list[RequestResult] = []
    n_turns = sum(len(s.user_turns) for s in sessions)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    num_started = 0
    async with httpx.AsyncClient(
        base_url=root_url(cfg.base_url), timeout=timeout, limits=limits, trust_env=False
    ) as client:
        start = time.perf_counter()
        deadline = start + cfg.max_duration_s if cfg.max_duration_s else math.inf

        async def launch(session: Session) -> None:
            nonlocal num_started
            async with slots or contextlib.nullcontext():
                if time.perf_counter() > deadline:
                    return
                num_started += 1
                await run_session(client, cfg, session, results, pbar)

        tasks: list[asyncio.Task[None]] = []

        async def drive() -> None:
            for session, gap in zip(sessions, gaps, strict=True):
                if gap > 0:
                    await asyncio.sleep(float(gap))
                if time.perf_counter() > deadline:
                    break
                tasks.append(asyncio.create_task(launch(session)))
            await asyncio.gather(*tasks)

        with tqdm(total=n_turns, disable=not progress, desc=desc, leave=False) as pbar:
            try:
                await asyncio.wait_for(drive(), timeout=cfg.cutoff_s)
            except asyncio.TimeoutError:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - start
    return LoadResult(results, duration, len(sessions) - num_started)


async def warm_up(cfg: LoadConfig, session: Session) -> RequestResult:
    """One short request (not measured) so that lazy start-up costs stay out of the numbers."""
    short = dataclasses.replace(cfg, output_len=min(cfg.output_len, 4))
    async with httpx.AsyncClient(
        base_url=root_url(cfg.base_url), timeout=cfg.timeout_s, trust_env=False
    ) as client:
        body = build_body(short, session, [], session.user_turns[0])
        result, _ = await send_request(client, short, body, session.turn_tokens[0])
    return result


def run_sweep(
    cfg: LoadConfig,
    spec: WorkloadSpec,
    builder_for: Callable[[random.Random], PromptBuilder],
    concurrencies: list[int | None],
    request_rate: float = math.inf,
    seed: int = 0,
    slo: dict[str, float] | None = None,
    progress: bool = True,
    warmup: bool = True,
) -> list[LevelResult]:
    """One load run per concurrency level, each with fresh prompts (so that a prefix cache
    cannot reuse the previous level's) but the same shared system prompt.

    `builder_for(rng) -> PromptBuilder` lets the caller plug in the server's tokenizer.
    """
    system = None
    if spec.name == "shared-prefix":
        system = builder_for(random.Random(f"{seed}:prefix")).text(spec.prefix_len)
    if warmup:
        warm = build_sessions(
            WorkloadSpec(spec.name, 1, spec.input_len, spec.prefix_len, 1),
            builder_for(random.Random(f"{seed}:warmup")),
            system,
        )
        asyncio.run(warm_up(cfg, warm[0]))
    levels = []
    for idx, concurrency in enumerate(concurrencies):
        builder = builder_for(random.Random(f"{seed}:level{idx}"))
        sessions = build_sessions(spec, builder, system)
        desc = f"concurrency={concurrency}" if concurrency else f"rate={request_rate}"
        load = asyncio.run(
            run_load(cfg, sessions, concurrency, request_rate, seed + idx, progress, desc)
        )
        metrics = compute_metrics(load.results, load.duration_s, slo)
        levels.append(LevelResult(concurrency, request_rate, load.num_skipped, metrics))
    return levels
