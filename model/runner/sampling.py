"""Per-row sampling: grammar masks, penalties, logit_bias, temperature, top_k / top_p / min_p,
seeded draws."""

from __future__ import annotations

import numpy as np
import torch

from model.runner.token_mask import apply_masks, masked_argmax
from scheduler.plan import SampleRow, StepOutput

GREEDY_TEMPERATURE = 1e-5
MAX_TOP_LOGPROBS = 20


def draw_seed(seed: int, output_index: int) -> int:
    """NOTE: the random stream of a draw depends on (seed, output_index) only."""
    return (seed * 1_000_003 + output_index) & 0x7FFF_FFFF_FFFF_FFFF


def is_plain_greedy(row: SampleRow) -> bool:
    """Argmax of the (masked) logits is the token."""
    p = row.params
    return (
        p.temperature < GREEDY_TEMPERATURE
        and not p.logit_bias
        and not p.needs_history
        and not row.suppress_ids
        and not p.logprobs
    )


def sample(
    logits: torch.Tensor, rows: list[SampleRow], masks: np.ndarray | None = None
) -> StepOutput:
    """logits: [len(rows), vocab] float32 raw model logits, row i for rows[i]; masks: the
    token bitmasks of the constrained rows ([len(rows), ceil(vocab / 32)] int32, model/token_mask)
    or None when no row is constrained. Logprobs are those of the raw distribution."""
    if not rows:
        return StepOutput(token_ids=[])
    raw = logits = logits.float().cpu()
    greedy = [is_plain_greedy(r) for r in rows]
    constrained = [i for i, r in enumerate(rows) if r.constraint is not None]
    if not constrained or masks is None:
        if all(greedy):
            # NOTE: numpy's argmax: torch's took 3-10 ms for [32, 49152] on the bench machine
            # (numpy 0.2 ms); both return the first maximum
            return StepOutput(token_ids=logits.numpy().argmax(axis=1).tolist())
        token_ids = [
            int(logits[i].argmax()) if greedy[i] else sample_row(logits[i], r)
            for i, r in enumerate(rows)
        ]
    else:
        # NOTE: greedy constrained rows never build a masked vocabulary (masked_argmax); the
        # others get their masks applied before penalties, temperature and the filters
        sampled = [i for i in constrained if not greedy[i]]
        logits = apply_masks(raw, masks, sampled) if sampled else raw
        raw_np = raw.numpy()
        token_ids = raw_np.argmax(axis=1).tolist()
        for i, r in enumerate(rows):
            if not greedy[i]:
                token_ids[i] = sample_row(logits[i], r)
            elif r.constraint is not None:
                token_ids[i] = masked_argmax(raw_np[i], masks[i], token_ids[i])
    if not any(r.params.logprobs for r in rows):
        return StepOutput(token_ids=token_ids)
    logprobs: list[float] = []
    top_logprobs: list[list[tuple[int, float]]] = []
    all_lp = torch.log_softmax(raw, dim=-1)  # [n, vocab] of the raw distribution
    for i, r in enumerate(rows):
        logprobs.append(float(all_lp[i, token_ids[i]]))
        k = min(max(r.params.top_logprobs, 0), MAX_TOP_LOGPROBS) if r.params.logprobs else 0
        if k == 0:
            top_logprobs.append([])
            continue
        values, ids = all_lp[i].topk(k)
        top_logprobs.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
    return StepOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top_logprobs)


def process_logits(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """Penalties, logit_bias and suppression on one row (its grammar mask already applied):
    [vocab] -> [vocab] (new tensor)."""
    p = row.params
    constrained = row.constraint is not None
    out = logits.clone()
    vocab = out.shape[0]
    if p.logit_bias:
        items = [(t, b) for t, b in p.logit_bias.items() if 0 <= t < vocab]
        if items:
            ids = torch.tensor([t for t, _ in items], dtype=torch.int64)
            out.index_add_(0, ids, torch.tensor([b for _, b in items], dtype=out.dtype))
    if p.needs_history and row.history:
        history = torch.tensor(row.history, dtype=torch.int64).clamp_(0, vocab - 1)
        if p.repetition_penalty != 1.0:  # HF RepetitionPenaltyLogitsProcessor
            seen = history.unique()
            sel = out[seen]
            penalised = torch.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
            out[seen] = penalised
        generated = history[row.num_prompt :]
        if generated.numel() and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
            counts = torch.bincount(generated, minlength=vocab).to(out.dtype)
            out -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
    if row.suppress_ids:
        ids = torch.tensor([t for t in row.suppress_ids if 0 <= t < vocab], dtype=torch.int64)
        kept = out.index_fill(0, ids, float("-inf"))
        # NOTE: min_tokens yields to a grammar that allows nothing but EOS
        out = kept if not constrained or bool(torch.isfinite(kept).any()) else out
    return out


def filtered_probs(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """The distribution a non-greedy row draws from: [vocab] float32 summing to 1."""
    p = row.params
    scaled = logits / p.temperature
    vocab = scaled.shape[0]
    if 0 < p.top_k < vocab:
        kth = scaled.topk(p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass strictly above each token
        drop_sorted = before >= p.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_row(logits: torch.Tensor, row: SampleRow) -> int:
    processed = process_logits(logits, row)
    if row.params.temperature < GREEDY_TEMPERATURE:
        return int(processed.argmax())
    probs = filtered_probs(processed, row)
    gen = torch.Generator(device="cpu").manual_seed(draw_seed(row.seed, row.output_index))
    return int(torch.multinomial(probs, 1, generator=gen))
