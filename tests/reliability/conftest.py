from __future__ import annotations

import time

import httpx
import pytest

from model import default_model_path
from model.load import gguf as gguf_loader
from model.load.tokenizer import Tokenizer
from tests.reliability.harness import ServerProcess, metric, scrape

CORPUS = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small "
    "tin of oil and a cloth. From the gallery he could see the fishing boats returning, their "
    "lanterns swaying like fireflies over the grey water. In winter the storms came from the "
    "north, and the waves broke so high against the rocks that the spray froze on the windows. "
    "He kept a logbook of every ship that passed, noting the hour, the wind, and the colour of "
    "the sky. Children from the village sometimes visited on Sundays and asked him whether he "
    "was lonely. He told them that the sea was never quiet enough to be lonely, and that the "
    "gulls argued with him about the weather. When the new electric lamp was installed, the "
    "engineers said his work was no longer needed, but he stayed on anyway, polishing brass and "
    "writing down the names of boats. Recipes for bread need flour, water, salt and yeast; the "
    "dough rests for an hour before it is shaped. Prime numbers such as 2, 3, 5, 7, 11 and 13 "
    "have no divisors other than one and themselves. The train to the capital leaves at seven "
    "and arrives before noon, stopping at four stations along the river valley."
)


def tokenize(url: str, text: str, headers: dict[str, str] | None = None) -> list[int]:
    resp = httpx.post(
        f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}, headers=headers
    )
    resp.raise_for_status()
    return list(resp.json()["tokens"])


def slots(url: str, headers: dict[str, str] | None = None) -> list:
    resp = httpx.get(f"{url}/slots", headers=headers, timeout=10.0)
    resp.raise_for_status()
    body = resp.json()
    return body["slots"] if isinstance(body, dict) else body


def wait_idle(url: str, timeout: float = 60.0, headers: dict[str, str] | None = None) -> dict:
    """Wait until no request is waiting or running and every live cell is a prefix-cache
    holder's; -> the metrics at that moment. Fails the test if it never happens."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url, headers)
        idle = (
            metric(samples, "cellserve_requests_running") == 0
            and metric(samples, "cellserve_requests_waiting") == 0
            and metric(samples, "cellserve_kv_cells_used")
            == metric(samples, "cellserve_kv_cells_cached")
            and not slots(url, headers)
        )
        if idle:
            return samples
        if time.monotonic() > deadline:
            pytest.fail(f"server not idle after {timeout} s: {samples}, slots={slots(url)}")
        time.sleep(0.1)


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer alone (no weights): token ids for prompts and the fault hooks."""
    path = default_model_path()
    reader = gguf_loader.open_gguf(path)
    fields = {k: v for k, v in reader.fields.items() if k.startswith("tok")}
    return Tokenizer.from_gguf(fields, path)


@pytest.fixture(scope="session")
def corpus_ids(tokenizer) -> list[int]:
    return tokenizer.encode(CORPUS, add_special=False)


@pytest.fixture(scope="session")
def default_server():
    """SmolLM2 with the default limits (what a user gets) but a small cache."""
    with ServerProcess(["--n-cells", "1024", "--n-seq-max", "16", "--ctx-per-seq", "512"]) as srv:
        yield srv
