"""The admission check (scheduler/intake.py): the rules the engine applies to every submitted
request, asked without side effects."""

from __future__ import annotations

import copy

import pytest

from scheduler.errors import PromptError
from scheduler.intake import check_fits_cache, check_request
from tests.scheduler.fakes import make_config, make_request


def test_check_request_passes_a_servable_request_and_changes_nothing() -> None:
    config = make_config()
    req = make_request("r", prompt_len=200, n=2, n_keep=4)  # past n_ctx_seq, shift on
    before = copy.deepcopy(req)
    check_request(req, config)
    assert req == before


def test_the_cache_rule_alone_is_what_the_server_asks_at_its_edge() -> None:
    """server/prompts.make_request calls check_fits_cache with the backend's geometry: the same
    rule and message the engine applies."""
    check_fits_cache(256, n_cells=256, n_ctx_seq=128)
    with pytest.raises(PromptError) as caught:
        check_fits_cache(257, n_cells=256, n_ctx_seq=128)
    config = make_config(n_cells=256, n_ctx_seq=128)
    with pytest.raises(PromptError) as engine_caught:
        check_request(make_request("big", prompt_len=257), config)
    assert str(caught.value) == str(engine_caught.value)
    assert caught.value.code == engine_caught.value.code == "context_length_exceeded"
