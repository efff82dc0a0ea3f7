from __future__ import annotations

import random

import pytest

from bench.workloads import PromptBuilder, WorkloadSpec, build_sessions


def count_words(text: str) -> int:
    return len(text.split())


def make_builder(seed: int = 0, counter=count_words) -> PromptBuilder:
    return PromptBuilder(random.Random(seed), counter)


@pytest.mark.parametrize("n_tokens", [1, 7, 256, 1000])
def test_calibrated_text_has_the_exact_token_count(n_tokens: int) -> None:
    text, count = make_builder().text(n_tokens)
    assert count == n_tokens == count_words(text)


def test_calibration_gets_as_close_as_the_tokenizer_allows() -> None:
    # two tokens per word plus a BOS token: only odd counts exist
    def two_per_word(text: str) -> int:
        return 2 * count_words(text) + 1

    text, count = make_builder(counter=two_per_word).text(101)
    assert count == 101 == two_per_word(text)
    text, count = make_builder(counter=two_per_word).text(100)
    assert abs(count - 100) == 1 and count == two_per_word(text)


def test_without_a_tokenizer_the_length_is_estimated() -> None:
    text, count = PromptBuilder(random.Random(0)).text(130)
    assert 100 <= count <= 160
    assert len(text.split()) > 50


def test_same_seed_same_prompts() -> None:
    spec = WorkloadSpec("random", num_prompts=3, input_len=20)
    first = build_sessions(spec, make_builder(seed=5))
    second = build_sessions(spec, make_builder(seed=5))
    other = build_sessions(spec, make_builder(seed=6))
    assert [s.user_turns for s in first] == [s.user_turns for s in second]
    assert [s.user_turns for s in first] != [s.user_turns for s in other]


def test_random_sessions_have_one_turn_and_no_system_prompt() -> None:
    sessions = build_sessions(WorkloadSpec("random", 4, input_len=30), make_builder())
    assert len(sessions) == 4
    assert all(s.system == "" and s.system_tokens == 0 for s in sessions)
    assert all(s.turn_tokens == [30] for s in sessions)
    assert len({s.user_turns[0] for s in sessions}) == 4


def test_shared_prefix_sessions_share_one_system_prompt() -> None:
    spec = WorkloadSpec("shared-prefix", 5, input_len=12, prefix_len=200)
    sessions = build_sessions(spec, make_builder())
    assert len({s.system for s in sessions}) == 1
    assert sessions[0].system_tokens == 200 == count_words(sessions[0].system)
    assert len({s.user_turns[0] for s in sessions}) == 5


def test_a_given_system_prompt_is_used_as_is() -> None:
    spec = WorkloadSpec("shared-prefix", 2, input_len=12, prefix_len=200)
    sessions = build_sessions(spec, make_builder(), system=("be brief", 2))
    assert all(s.system == "be brief" and s.system_tokens == 2 for s in sessions)


def test_multi_turn_sessions_have_the_requested_turns() -> None:
    spec = WorkloadSpec("multi-turn", 3, input_len=10, turns=4)
    sessions = build_sessions(spec, make_builder())
    assert spec.num_requests() == 12
    assert [len(s.user_turns) for s in sessions] == [4, 4, 4]
    assert all(s.turn_tokens == [10] * 4 for s in sessions)


def test_unknown_workload_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        build_sessions(WorkloadSpec("sharegpt", 1), make_builder())
