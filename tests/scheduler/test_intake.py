"""The admission check (scheduler/intake.py): the rules the engine applies to every submitted
request, asked without side effects."""

from __future__ import annotations

import copy

import pytest

from scheduler.errors import FieldError, PromptError
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


def test_min_tokens_past_max_tokens_is_refused_naming_the_field() -> None:
    """The engine's rule, whoever submits: the server maps FieldError to a 400 whose param is
    the field (server/errors.engine_error)."""
    config = make_config()
    check_request(make_request("ok", prompt_len=8, max_tokens=4, min_tokens=4), config)
    with pytest.raises(FieldError) as caught:
        check_request(make_request("r", prompt_len=8, max_tokens=4, min_tokens=5), config)
    assert caught.value.param == "min_tokens"
