"""Sampling on constructed distributions: every knob changes what can be drawn."""

from __future__ import annotations

import math

import torch

from model.runner.sampling import draw_seed, filtered_probs, process_logits, sample
from scheduler.plan import SampleRow, SamplingParams

VOCAB = 8


def make_row(seed: int = 0, output_index: int = 0, **params) -> SampleRow:
    history = params.pop("history", None)
    num_prompt = params.pop("num_prompt", 0)
    suppress = params.pop("suppress_ids", ())
    return SampleRow(
        row=0,
        params=SamplingParams(**params),
        seed=seed,
        output_index=output_index,
        num_prompt=num_prompt,
        history=history,
        suppress_ids=suppress,
    )


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) if p > 0 else -1e9 for p in probs])


PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]
LOGITS = logits_from_probs(PROBS)


def draws(row_kwargs: dict, n: int = 300, logits: torch.Tensor = LOGITS) -> set[int]:
    return {
        sample(logits[None], [make_row(seed=7, output_index=i, **row_kwargs)]).token_ids[0]
        for i in range(n)
    }


def test_greedy_is_argmax_in_a_batch():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    rows = [make_row(temperature=0.0) for _ in range(5)]
    assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_same_seed_and_index_repeat_whatever_the_batch():
    row = make_row(seed=42, output_index=3, temperature=1.0)
    alone = sample(LOGITS[None], [row]).token_ids
    batched = sample(
        torch.stack([LOGITS.flip(0), LOGITS, LOGITS]),
        [
            make_row(seed=1, temperature=1.0),
            row,
            make_row(seed=42, output_index=3, temperature=1.0),
        ],
    ).token_ids
    assert batched[1:] == alone * 2
    assert draw_seed(42, 3) != draw_seed(42, 4) and draw_seed(2**70, 1) < 2**63


def test_temperature_one_reaches_the_tail():
    assert draws({"temperature": 1.0}, n=600) >= {0, 1, 2, 3, 4}


def test_top_k_keeps_k_best():
    assert draws({"temperature": 1.0, "top_k": 2}) == {0, 1}


def test_top_p_keeps_smallest_set_reaching_p():
    probs = filtered_probs(LOGITS, make_row(temperature=1.0, top_p=0.7))
    assert (probs > 0).tolist() == [True, True, True] + [False] * 5  # 0.4+0.25 < 0.7
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)
    assert math.isclose(float(probs[0]), 0.4 / 0.8, rel_tol=1e-5)
    assert draws({"temperature": 1.0, "top_p": 0.7}) == {0, 1, 2}


def test_min_p_drops_below_fraction_of_best():
    probs = filtered_probs(LOGITS, make_row(temperature=1.0, min_p=0.3))  # 0.3 * 0.4 = 0.12
    assert (probs > 0).tolist() == [True, True, True] + [False] * 5


def test_low_temperature_sharpens():
    probs = filtered_probs(LOGITS, make_row(temperature=0.25))
    assert float(probs[0]) > 0.8


def test_logit_bias_and_suppress():
    row = make_row(temperature=0.0, logit_bias={5: 100.0})
    assert sample(LOGITS[None], [row]).token_ids == [5]
    row = make_row(temperature=0.0, suppress_ids=(0, 1))
    assert sample(LOGITS[None], [row]).token_ids == [2]
    assert draws({"temperature": 1.0, "suppress_ids": (0,)}).isdisjoint({0})


def test_repetition_penalty_hf_style():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    row = make_row(repetition_penalty=2.0, history=[0, 1, 1], num_prompt=3)
    assert process_logits(logits, row).tolist() == [1.0, -4.0, 1.0, 0.5]


def test_presence_and_frequency_only_over_generated_tokens():
    logits = torch.zeros(4)
    row = make_row(
        presence_penalty=0.5, frequency_penalty=0.25, history=[3, 3, 0, 0, 0, 1], num_prompt=2
    )
    # generated: [0, 0, 0, 1]; the prompt's 3s are not penalised
    assert process_logits(logits, row).tolist() == [-1.25, -0.75, 0.0, 0.0]


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([3.0, 2.9, 0.0])
    row = make_row(temperature=0.0, frequency_penalty=1.0, history=[5, 0], num_prompt=1)
    assert sample(logits[None], [row]).token_ids == [1]


def test_logprobs_are_of_the_raw_distribution():
    row = make_row(
        temperature=0.0, logprobs=True, top_logprobs=3, logit_bias={4: 50.0}
    )  # the bias picks token 4 but the logprob reports the model's own
    out = sample(LOGITS[None], [row])
    assert out.token_ids == [4]
    assert out.logprobs is not None and out.top_logprobs is not None
    assert math.isclose(out.logprobs[0], math.log(0.05), abs_tol=1e-5)
    assert [t for t, _ in out.top_logprobs[0]] == [0, 1, 2]
    assert math.isclose(out.top_logprobs[0][0][1], math.log(0.4), abs_tol=1e-5)


def test_logprobs_without_top_give_empty_lists():
    out = sample(
        LOGITS[None].repeat(2, 1),
        [make_row(temperature=0.0), make_row(logprobs=True, temperature=0.0)],
    )
    assert out.token_ids == [0, 0]
    assert out.top_logprobs == [[], []] and out.logprobs is not None and len(out.logprobs) == 2
