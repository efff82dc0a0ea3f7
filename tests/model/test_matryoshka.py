"""config.json's Matryoshka declaration (model/load/matryoshka.py): which `dimensions` of
/v1/embeddings a model serves, as vLLM reads `matryoshka_dimensions` and `is_matryoshka`."""

from __future__ import annotations

from pathlib import Path

import pytest

from model.errors import ModelLoadError
from model.load.matryoshka import read_matryoshka

WHERE = Path("config.json")


def test_a_list_allows_exactly_its_sizes_and_the_full_one():
    m = read_matryoshka({"matryoshka_dimensions": [128, 768, 256, 512]}, 768, WHERE)
    assert m is not None
    assert [n for n in range(1, 1025) if m.allows(n, 768)] == [128, 256, 512, 768]
    assert m.describe(768) == "128, 256, 512, 768"
    m = read_matryoshka({"matryoshka_dimensions": [16, 8]}, 32, WHERE)  # the full size unlisted
    assert m is not None and m.allows(32, 32) and m.describe(32) == "8, 16, 32"


def test_is_matryoshka_allows_any_size_up_to_the_full_one():
    m = read_matryoshka({"is_matryoshka": True}, 32, WHERE)
    assert m is not None
    assert [n for n in range(0, 40) if m.allows(n, 32)] == list(range(1, 33))
    assert m.describe(32) == "any size from 1 to 32"


@pytest.mark.parametrize(
    "config",
    [{}, {"is_matryoshka": False}, {"matryoshka_dimensions": []}, {"is_matryoshka": "yes"}],
)
def test_no_declaration_is_none(config):
    assert read_matryoshka(config, 32, WHERE) is None


@pytest.mark.parametrize("listed", [[8, 64], [0, 8], ["16"], [True], 16])
def test_a_list_past_the_model_or_not_of_sizes_is_a_load_error(listed):
    with pytest.raises(ModelLoadError, match="matryoshka_dimensions"):
        read_matryoshka({"matryoshka_dimensions": listed}, 32, WHERE)
