"""A submitted Request -> the prompt the model reads, and the sequences of its choices.

`check_request` is the one admission check: the scheduler applies it to every request, whoever
submits it; the server maps what it raises to HTTP (server/errors.engine_error) rather than
re-implementing its rules.
"""

from __future__ import annotations

from scheduler.config import EngineConfig
from scheduler.context_shift import clamp_n_keep, truncate_prompt
from scheduler.errors import FieldError, PromptError
from scheduler.request import Request
from scheduler.sequence import Sequence


def shift_enabled(request: Request, config: EngineConfig) -> bool:
    return config.context_shift if request.context_shift is None else request.context_shift


def check_request(request: Request, config: EngineConfig) -> None:
    """Raises PromptError (the prompt) or ValueError (another field) for a request the engine
    cannot serve; never mutates."""
    if not request.prompt_ids:
        raise PromptError("empty prompt: the prompt has no tokens")
    if request.n < 1 or request.n > config.n_seq_max:
        raise ValueError(f"n must be in [1, {config.n_seq_max}], got {request.n}")
    if request.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
    if request.embed and request.n != 1:
        raise ValueError(f"an embedding request has one choice, got n={request.n}")
    if request.min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {request.min_tokens}")
    check_min_tokens(request.min_tokens, request.max_tokens)
    num_prompt = len(request.prompt_ids)
    if num_prompt >= _context_limit(request, config) and not shift_enabled(request, config):
        raise PromptError(
            f"the prompt has {num_prompt} tokens; the context is "
            f"{config.n_ctx_seq} tokens and context shift is off",
            code="context_length_exceeded",
        )
    check_fits_cache(num_prompt, config.n_cells, config.n_ctx_seq)


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    """A request cannot be held to more tokens than it may generate."""
    if min_tokens > max_tokens:
        raise FieldError("min_tokens must not exceed max_tokens", param="min_tokens")


def check_fits_cache(num_prompt: int, n_cells: int, n_ctx_seq: int) -> None:
    """A prompt past the context is shifted (its middle dropped, llama.cpp style) when context
    shift is on; one longer than the whole KV cache is refused rather than lose most of it."""
    if num_prompt > n_cells:
        raise PromptError(
            f"the prompt has {num_prompt} tokens, more than the whole KV cache "
            f"({n_cells} cells); the context is {n_ctx_seq} tokens",
            code="context_length_exceeded",
        )


def _context_limit(request: Request, config: EngineConfig) -> int:
    """Prompts of at least this many tokens are past the context."""
    # NOTE: an embedding generates nothing: its prompt may fill the whole context
    return config.n_ctx_seq + 1 if request.embed else config.n_ctx_seq


def prepare_prompt(request: Request, config: EngineConfig) -> list[int]:
    """The prompt the model will read, of a request that passed check_request."""
    if len(request.prompt_ids) < _context_limit(request, config):
        return list(request.prompt_ids)
    n_keep = clamp_n_keep(request.n_keep, len(request.prompt_ids), config.n_ctx_seq)
    return truncate_prompt(list(request.prompt_ids), n_keep, config.n_ctx_seq)


def make_choices(request: Request, prompt: list[int], seed: int, now: float) -> list[Sequence]:
    """One sequence per choice; choice i draws from seed + i. Choice 0 reads the prompt and
    carries the others in `forks` until it is computed."""
    seqs = [
        Sequence(request, i, seed + i, list(prompt), list(prompt), submit_time=now)
        for i in range(request.n)
    ]
    seqs[0].forks = seqs[1:]
    if request.grammar is not None:  # the forks copy it when they fork (Scheduler._fork)
        seqs[0].constraint = request.grammar.new_constraint()
    for s in seqs[1:]:
        s.parent = seqs[0]
    return seqs
